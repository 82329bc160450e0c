"""The docs hold what they say: every repository path they cite exists, every code block a reader may copy
is run here or by the test that names it, the CI commands they give are .ci/run's, and the README stays short."""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from doc_snippets import REPO, all_snippets, doc_files, doc_snippet
from trainer_utils import FAST

ROOT = REPO
DOCS = [str(p.relative_to(ROOT)) for p in doc_files()] + ["benchmarks/RESULTS.md", "CHANGELOG.md"]
# Source folders of this repository. ``vidstab/...`` paths count only as source files (``.py`` or a
# package folder): ``vidstab/recovery.json`` and ``vidstab/checkpoints/`` are paths inside a run folder.
CITED = re.compile(r"`((?:tests|benchmarks|recipes|examples|scripts|docs)/[\w/.*\-]+|vidstab/[\w/\-]+(?:\.py)?)[`:( ]")
PYTHON_SNIPPETS = [s for s in all_snippets() if s.lang == "python"]


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
            "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


@pytest.mark.parametrize("doc", DOCS)
def test_every_cited_repository_path_exists(doc):
    text = (ROOT / doc).read_text(encoding="utf-8")
    missing = []
    for cited in sorted(set(CITED.findall(text))):
        path = cited.rstrip("./")
        if path.startswith("benchmarks/.cache"):  # recordings the benchmarks write (git-ignored): absent on a fresh clone
            continue
        if not (list(ROOT.glob(path)) or list(ROOT.glob(path + "*")) or (ROOT / path).exists()):
            missing.append(cited)
    assert not missing, f"{doc} cites paths that do not exist: {missing}"


def test_readme_is_short():
    assert len((ROOT / "README.md").read_bytes()) <= 15_000


def test_every_code_block_is_marked_and_every_name_is_run_by_a_test():
    # the test files that read blocks by name (doc_snippet), and the names they quote
    readers = [p.read_text(encoding="utf-8") for p in (ROOT / "tests").glob("test_*.py")]
    tests_text = "\n".join(t for t in readers if "doc_snippet" in t)
    problems = []
    for s in all_snippets():
        if s.lang == "":
            problems.append(f"{s.path}:{s.line}: a block without a language tag: `text` for output, file trees and "
                            f"outlines; bash, python, yaml ... with <!-- snippet: NAME --> for what users copy")
            continue
        if s.lang == "text":
            continue  # output, file trees and outlines: nothing to copy and run
        if s.lang != "python" and s.name is None:
            problems.append(f"{s.path}:{s.line}: a {s.lang} block without <!-- snippet: NAME -->")
        elif s.lang != "python" and f'"{s.name}"' not in tests_text:
            problems.append(f"{s.path}:{s.line}: no test reads the block {s.name!r} with doc_snippet")
    assert not problems, "\n".join(problems)


@pytest.mark.parametrize("snippet", PYTHON_SNIPPETS, ids=[f"{s.path}:{s.line}" for s in PYTHON_SNIPPETS])
def test_python_snippet_runs(snippet, tmp_path):
    script = tmp_path / "snippet.py"
    script.write_text(snippet.code + "\n")
    done = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, f"{snippet.path}:{snippet.line}\n{done.stderr[-3000:]}"


def _commands(text: str) -> list[str]:
    return [line.strip() for line in text.splitlines() if line.strip() and not line.lstrip().startswith("#")]


def test_the_test_commands_are_exactly_what_ci_runs():
    ci = [x for x in _commands((ROOT / ".ci" / "run").read_text()) if not x.startswith(("set ", "cd ", "export "))]
    assert _commands(doc_snippet("ci-commands")) == ci


def test_install_commands_name_extras_that_exist():
    extras = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"])
    for block in (doc_snippet("install-readme"), doc_snippet("install-extras"), doc_snippet("install-deepspeed")):
        for line in _commands(block):
            assert line.startswith("pip install "), line
            asked = re.findall(r"(?:vidstab|\"\.)\[([\w,]+)\]", line)
            assert all(set(a.split(",")) <= extras for a in asked), (line, extras)
    main_job = _commands(doc_snippet("main-job"))
    install = main_job[0].split(" && ")
    assert install[0] == _commands(doc_snippet("ci-commands"))[0].split(" && ")[0]  # the same torch as CI
    for extra in re.findall(r'"\.\[([\w,]+)\]"', main_job[0]):
        assert set(extra.split(",")) <= extras


def test_main_job_command_runs(tmp_path):
    """The main job's launch, as given, with the tests' small, short settings appended (the full default run
    takes minutes; tests/test_train.py runs the default model size)."""
    (launch,) = _commands(doc_snippet("main-job"))[1:]
    assert launch == "accelerate launch recipes/train.py"
    cmd = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", "1", "--mixed_precision", "no",
           "--dynamo_backend", "no", "recipes/train.py", "--output_dir", str(tmp_path / "run"), *FAST,
           "--max_train_steps", "2", "--num_validation_videos", "0"]
    done = subprocess.run(cmd, cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert (tmp_path / "run" / "vidstab" / "events-rank0.jsonl").is_file()


def test_sample_exported_command_runs(tmp_path):
    out = tmp_path / "run"
    subprocess.run([sys.executable, "recipes/train.py", "--output_dir", str(out), *FAST, "--max_train_steps", "2",
                    "--num_validation_videos", "0"], cwd=ROOT, env=_env(), check=True, capture_output=True, timeout=300)
    command = doc_snippet("sample-exported").replace("output/vidstab-tiny", str(out))
    done = subprocess.run(["bash", "-c", command.replace("python ", f"{sys.executable} ", 1) + " --num_videos 1"],
                          cwd=ROOT, env=_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]


def test_cli_commands_around_an_incident_run(nan_batch_rank1_run, tmp_path):
    out = tmp_path / "vidstab-tiny"
    shutil.copytree(nan_batch_rank1_run, out)  # the shared run stays as the other tests read it
    (bundle,) = [line.split()[2] for line in _commands(doc_snippet("cli-around-an-incident")) if line.startswith("vidstab replay")]
    assert (out / Path(bundle).relative_to("output/vidstab-tiny")).is_dir(), bundle
    bin_dir = Path(sys.executable).parent
    env = {**_env(), "PATH": os.pathsep.join([str(bin_dir), os.environ.get("PATH", "")])}
    for line in _commands(doc_snippet("cli-around-an-incident")):
        command = line.split("  #")[0].replace("output/vidstab-tiny", str(out))
        done = subprocess.run(["bash", "-c", command], cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, f"{command}\n{done.stdout[-2000:]}\n{done.stderr[-2000:]}"
