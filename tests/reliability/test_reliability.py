"""The reliability campaigns, a fast seeded subset of each: no trial may have a bad outcome.

``make reliability`` (``python -m tests.reliability --full``) runs the same campaigns with
hundreds of trials. A failure message holds the table of outcomes and examples of each bad one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from . import race
from .campaigns import FAST, SEED
from .corrupt import KINDS as DAMAGE_KINDS
from .corrupt import run_corrupt
from .fuzz_metadata import run_fuzz
from .importers import KINDS, run_importers
from .kill import run_kill
from .manager import run_manager
from .nodeloss import run_nodeloss
from .race import run_race
from .sandbox import Result


def test_kill_9_leaves_the_last_checkpoint_loadable_and_the_next_save_clean(tmp_path: Path) -> None:
    report = run_kill(FAST["kill"], SEED, workdir=str(tmp_path))
    assert report.trials == FAST["kill"]
    assert report.bad == {}, report.failure_message()


def test_every_damaged_byte_is_detected_by_every_read_path_that_returns_it(tmp_path: Path) -> None:
    report = run_corrupt(FAST["corrupt"], SEED, workdir=str(tmp_path))
    assert report.trials == FAST["corrupt"]
    assert report.counts["detected"] > 0
    assert {p.split("/")[0] for p in report.by_path if "/" in p} == set(DAMAGE_KINDS)  # every kind of damage ran
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


def test_nodes_lost_at_random_moments_restore_bit_exact_never_older_than_safe(tmp_path: Path) -> None:
    report = run_nodeloss(FAST["nodeloss"], SEED, workdir=str(tmp_path))
    assert report.trials == FAST["nodeloss"]
    assert report.counts["ok"] == report.trials, report.failure_message()
    assert report.bad == {}, report.failure_message()


class _Answers:
    """A sandbox stand-in that answers every call with the same result."""

    def __init__(self, result: Result) -> None:
        self.result = result

    def call(self, fn: Any, *args: Any, roots: list[str], timeout: float | None = None) -> Result:
        return self.result


def test_a_race_check_that_hangs_is_a_hang_and_one_that_raises_is_a_lost_checkpoint(tmp_path: Path) -> None:
    """The racing campaign's check of the directory: a load that raised means the checkpoint is
    lost; one that did not answer (a busy machine, or a hang) is reported as what it was."""
    args = (str(tmp_path / "ckpt"), [3], {3: str(tmp_path / "truth")}, str(tmp_path / "out"))
    hung = Result("hang", message="no answer after 35.2 s of CPU time (killed)")
    assert race._check_dir(_Answers(hung), *args) == ["hang (: no answer after 35.2 s of CPU time (killed))"]
    died = Result("crashed", error_type="exit -9", message="the worker died (exit code -9)")
    assert race._check_dir(_Answers(died), *args) == ["worker-crash (exit -9: the worker died (exit code -9))"]
    lost = Result("raised", error_type="shardsafe.errors.IncompleteCheckpointError", message="no metadata.json",
                  checkpoint_error=True)
    assert race._check_dir(_Answers(lost), *args) == ["lost-checkpoint (shardsafe.errors.IncompleteCheckpointError: no metadata.json)"]
