"""The installed ``shardsafe`` console script, run in subprocesses as a user's shell runs it:
exit statuses, messages, ``--debug``, a checkpoint in the S3 server the tests start, the exact
JSON keys of every command (against what each command's ``--help`` documents), and the
progress bar of ``export`` and ``convert`` on a terminal."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import safetensors.torch
import torch

import shardsafe
from shardsafe import Checkpointer
from shardsafe.cli import JSON_SCHEMAS, main

from .terminal import on_a_pty
from .test_cli import _data_file, s3  # noqa: F401 - s3: the S3 server with the standard AWS variables set

ROOT = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "PYTHONPATH": f"{ROOT / 'src'}{os.pathsep}{ROOT}"}  # the script imports this checkout


def _script() -> list[str]:
    """The console script installed beside this interpreter, else on PATH, else ``python -m``."""
    beside = Path(sys.executable).parent / "shardsafe"
    if beside.is_file():
        return [str(beside)]
    found = shutil.which("shardsafe")
    return [found] if found else [sys.executable, "-m", "shardsafe"]


SCRIPT = _script()


def run(*args: object, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    (r,) = run_all([args], env=env)
    return r


def run_all(commands: list[tuple | list], env: dict[str, str] | None = None) -> list[subprocess.CompletedProcess]:
    """Run the script once per argument list, all at once (each start imports torch: seconds), in order."""
    procs = [
        (subprocess.Popen([*SCRIPT, *map(str, a)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env or ENV), a)
        for a in commands
    ]
    out = []
    for p, a in procs:
        stdout, stderr = p.communicate(timeout=120)
        out.append(subprocess.CompletedProcess([*SCRIPT, *a], p.returncode, stdout, stderr))
    return out


def _state(seed: int = 0) -> dict:
    g = torch.Generator().manual_seed(seed)
    return {
        "model.w": torch.randn(100, generator=g),  # 400 bytes
        "model.b": torch.arange(3),
        "step": 3,
    }


@pytest.fixture
def ckpt(tmp_path) -> Path:
    d = tmp_path / "a"
    Checkpointer().save(d, _state())
    return d




def test_the_console_script_is_installed_in_this_environment():
    assert Path(SCRIPT[0]).name == "shardsafe" and os.access(SCRIPT[0], os.X_OK), SCRIPT  # not the python -m fallback
    r = run("--version")
    assert (r.returncode, r.stdout) == (0, f"shardsafe {shardsafe.__version__}\n")


def test_corrupt_checkpoint_exits_1_naming_file_and_key(ckpt):
    ((file, spec),) = Checkpointer().get_metadata(ckpt, no_dist=True).tensors["model.w"].chunks()
    raw = bytearray((ckpt / file).read_bytes())
    raw[spec.byte_range[0] + 200] ^= 0x01
    (ckpt / file).write_bytes(bytes(raw))
    first, every, inspect = run_all([("verify", ckpt), ("verify", ckpt, "--all"), ("inspect", ckpt)])
    for extra, r in (([], first), (["--all"], every)):
        assert (r.returncode, r.stderr) == (1, ""), r.stderr
        bad, status = r.stdout.splitlines()
        assert bad.startswith(f"BAD  {_data_file(ckpt)}: key 'model.w': checksum mismatch in chunk ")
        assert "bytes [0, 400) of the chunk (block 0)" in bad and bad.endswith("the file is damaged")
        counted = "1 chunk(s), 400" if not extra else "2 chunk(s), 424"  # the bad chunk's 400 bytes are counted
        assert status.startswith("FAILED: ") and status.endswith(f": 1 file(s), {counted} bytes checked"), status
    # inspect reads the metadata only: the damage does not show
    assert inspect.returncode == 0 and inspect.stdout.startswith(f"checkpoint      {ckpt}\n")


def test_missing_and_non_checkpoint_folders_exit_2_with_the_message(tmp_path, capsys):
    (tmp_path / "other").mkdir()
    (tmp_path / "other" / "notes.txt").write_text("hi")
    r, missing = run_all([("verify", tmp_path / "other"), ("inspect", tmp_path / "nope")])
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr == (
        f"shardsafe verify: error: {tmp_path / 'other'}: not a checkpoint: it holds 1 file(s) (notes.txt; kinds: txt) and none of "
        "a checkpoint's: no metadata.json and no shard-r*.safetensors data file. Point at the directory a save wrote (it holds metadata.json)\n"
    )
    assert r.stderr.count("\n") == 1 and "Traceback" not in r.stderr
    assert (missing.returncode, missing.stdout) == (2, "")
    assert missing.stderr == f"shardsafe inspect: error: {tmp_path / 'nope'}: no such checkpoint: the directory does not exist (is the path mistyped?)\n"
    with pytest.raises(SystemExit) as e:  # a usage error: argparse's message, exit 2 (in this process: the same parser)
        main(["inspect"])
    assert e.value.code == 2 and "the following arguments are required: dir" in capsys.readouterr().err


def test_debug_prints_the_traceback_and_still_exits_2(tmp_path):
    r = run("verify", tmp_path / "nope", "--debug")
    assert (r.returncode, r.stdout) == (2, "")
    assert r.stderr.startswith("Traceback (most recent call last):\n")
    assert "shardsafe.errors.IncompleteCheckpointError: " in r.stderr
    assert r.stderr.endswith(f"shardsafe verify: error: {tmp_path / 'nope'}: no such checkpoint: the directory does not exist (is the path mistyped?)\n")


# ------------------------------------------------------------------ on S3




def test_diff_on_s3(s3):  # noqa: F811 - the fixture imported above
    url = s3.url()
    a, b = url + "-a", url + "-b"
    Checkpointer().save(a, _state(0))
    s = _state(0)
    s["model.w"] = s["model.w"].clone()
    s["model.w"][7] += 0.25
    s["step"] = 4
    Checkpointer().save(b, s)
    env = {**os.environ, "PYTHONPATH": ENV["PYTHONPATH"]}  # the server's address and keys, as the standard AWS variables
    r, same, missing = run_all([("diff", a, b, "--values"), ("diff", a, a, "--values", "--json"), ("diff", a, url + "-missing")], env=env)
    assert (r.returncode, r.stderr) == (1, ""), r.stderr
    assert r.stdout.splitlines() == [
        "value          step  3 -> 4",
        "max |A-B|      model.w  0.25",
        "A and B differ (2 common tensors, values compared with atol 0)",
    ]
    assert same.returncode == 0, same.stderr
    doc = json.loads(same.stdout)
    assert (doc["same"], doc["max_abs_diff"]) == (True, {"model.b": 0.0, "model.w": 0.0})
    assert missing.returncode == 2 and f"{url}-missing: not a committed checkpoint" in missing.stderr


# ------------------------------------------------------------------ JSON


def _documented(command: str, capsys) -> list[str]:
    """The top-level keys the command's ``--help`` epilog lists (parenthesised details dropped)."""
    with pytest.raises(SystemExit) as e:
        main([command, "--help"])  # in this process: the script's help is the same parser's
    assert e.value.code == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps the epilog
    (listed,) = re.findall(r"--json prints one object: (.*)\.$", text)
    while "(" in listed:
        listed = re.sub(r"\([^()]*\)", "", listed)
    return [k.strip() for k in listed.split(",")]


def test_json_keys_of_every_command_are_exact_and_documented(ckpt, tmp_path, capsys):
    other = tmp_path / "b"
    Checkpointer().save(other, {**_state(1), "model.extra": torch.zeros(2)})
    safetensors.torch.save_file({"w": torch.ones(3), "b": torch.zeros(2)}, tmp_path / "hf.safetensors", metadata={"note": "hi"})
    commands = {
        "inspect": [("inspect", ckpt)],
        "verify": [("verify", ckpt)],
        "diff": [("diff", ckpt, other, "--values")],
        "export": [("export", ckpt, tmp_path / "m.safetensors"), ("export", ckpt, tmp_path / "hf", "--max-shard-size", "100B")],
        "convert": [("convert", tmp_path / "hf.safetensors", tmp_path / "c", "--from", "hf")],
        "consolidate": [("consolidate", ckpt, tmp_path / "l.ckpt")],
    }
    assert set(commands) == set(JSON_SCHEMAS)
    results = iter(run_all([(*a, "--json") for found in commands.values() for a in found]))
    docs = {command: [json.loads(next(results).stdout) for _ in found] for command, found in commands.items()}
    for command, found in docs.items():
        for doc in found:
            assert list(doc) == _documented(command, capsys), command  # the keys, in the documented order
    assert main(["diff", str(ckpt), str(other), "--json"]) == 1  # without --values: the same keys
    assert list(json.loads(capsys.readouterr().out)) == _documented("diff", capsys)
    (inspect,) = docs["inspect"]
    assert inspect["tensors"]["model.w"] == {"shape": [100], "dtype": "float32", "bytes": 400, "chunks": 1, "sharded": False}
    assert inspect["files"] == {_data_file(ckpt).name: _data_file(ckpt).stat().st_size}
    assert (inspect["values"], inspect["pickled_values"]) == ({"step": 3}, [])
    assert docs["verify"][0] == {"location": str(ckpt), "ok": True, "files": 1, "chunks": 2, "bytes": 424, "errors": []}
    (values,) = docs["diff"]
    assert (values["same"], values["only_in_a"], values["only_in_b"]) == (False, [], ["model.extra"])
    assert set(values["max_abs_diff"]) == {"model.b", "model.w"}
    one, folder = docs["export"]
    assert (one["files"], folder["files"], one["tensors"], one["bytes"], one["values"]) == (1, 2, 2, 424, 1)
    assert docs["consolidate"][0] == {"dir": str(ckpt), "out": str(tmp_path / "l.ckpt"), "tensors": 2, "bytes": 424, "file_bytes": (tmp_path / "l.ckpt").stat().st_size}
    assert docs["convert"][0] == {"src": str(tmp_path / "hf.safetensors"), "dst": str(tmp_path / "c"), "from": "hf", "tensors": 2, "values": 1}


# ------------------------------------------------------------------ progress bars


def test_export_and_convert_draw_a_bar_on_a_terminal_only(ckpt, tmp_path, capsys):
    r, err = on_a_pty([*SCRIPT, "export", str(ckpt), str(tmp_path / "m.safetensors")], ENV)
    assert r.returncode == 0 and r.stdout == f"exported 2 tensors (424 B) to {tmp_path / 'm.safetensors'}\n".encode()
    assert b"\rexport:   0%|" in err and b"/424 [" in err  # tqdm: bytes done / total, rate, ETA
    torch.save(_state(), tmp_path / "sd.pt")
    r, err = on_a_pty([*SCRIPT, "convert", str(tmp_path / "sd.pt"), str(tmp_path / "c"), "--from", "torch"], ENV)
    assert r.returncode == 0, err
    assert b"\rconvert:   0%|" in err and b"/424 [" in err
    assert main(["export", str(ckpt), str(tmp_path / "m2.safetensors")]) == 0  # stderr not a terminal: no bar
    assert main(["convert", str(tmp_path / "sd.pt"), str(tmp_path / "c2"), "--from", "torch"]) == 0
    assert capsys.readouterr().err == ""
