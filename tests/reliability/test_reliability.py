"""The reliability campaigns, a fast seeded subset of each: no trial may have a bad outcome.

``make reliability`` (``python -m tests.reliability --full``) runs the same campaigns with
hundreds of trials. A failure message holds the table of outcomes and examples of each bad one.
"""

from __future__ import annotations

from pathlib import Path

from .campaigns import FAST, SEED
from .corrupt import run_corrupt
from .fuzz_metadata import run_fuzz
from .importers import KINDS, run_importers
from .kill import run_kill
from .manager import run_manager
from .race import run_race


def test_kill_9_leaves_the_last_checkpoint_loadable_and_the_next_save_clean(tmp_path: Path) -> None:
    report = run_kill(FAST["kill"], SEED, workdir=str(tmp_path))
    assert report.trials == FAST["kill"]
    assert report.bad == {}, report.failure_message()


def test_every_damaged_byte_is_detected_by_every_read_path_that_returns_it(tmp_path: Path) -> None:
    report = run_corrupt(FAST["corrupt"], SEED, workdir=str(tmp_path))
    assert report.trials == FAST["corrupt"]
    assert report.counts["detected"] > 0
    assert report.bad == {}, report.failure_message()


def test_hostile_metadata_and_headers_raise_only_checkpoint_errors_within_bounds(tmp_path: Path) -> None:
    report = run_fuzz(FAST["fuzz"], SEED, workdir=str(tmp_path))
    assert report.trials == FAST["fuzz"]
    assert report.bad == {}, report.failure_message()


def test_racing_jobs_one_wins_the_other_is_refused_nothing_is_lost(tmp_path: Path) -> None:
    report = run_race(FAST["race"], SEED, workdir=str(tmp_path))
    assert report.trials == FAST["race"]
    assert report.bad == {}, report.failure_message()


def test_the_manager_counts_only_intact_steps_and_loses_none_to_damage_or_kill_9(tmp_path: Path) -> None:
    report = run_manager(FAST["manager"], SEED, workdir=str(tmp_path))
    assert report.trials == FAST["manager"]
    assert report.counts["ok"] > 0
    assert report.bad == {}, report.failure_message()


def test_hostile_foreign_checkpoints_raise_only_checkpoint_errors_in_every_importer_and_cli_command(tmp_path: Path) -> None:
    report = run_importers(FAST["importers"], SEED, workdir=str(tmp_path))
    assert report.trials == FAST["importers"]
    assert report.counts["detected"] > 0
    assert report.bad == {}, report.failure_message()
    assert sum(report.notes[f"trials:{k}"] for k in KINDS) == report.trials
