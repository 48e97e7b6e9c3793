"""sbatch reads any unique prefix of a long option (issue 33, item 4): an extra_sbatch key is read
the same way before the refusal of the options hpcfsdp sets itself. The option table kept in the
package is checked against the local cluster's sbatch, of the release it runs (22.05 on Debian 12,
24.11 on Debian 13: issue 53), and the requeue guard holds for slurm.max_requeue 0."""

from __future__ import annotations

import subprocess

import pytest
import yaml

from hpcfsdp.cli import main
from hpcfsdp.sweep.define import sbatch_options
from hpcfsdp.sweep.define.sbatch_options import options_of, release_options, resolve_option, running_release

OPTIONS = release_options((22, 5))


@pytest.mark.parametrize(
    ("key", "read_as"),
    [("arr", "array"), ("requeu", "requeue"), ("no-req", "no-requeue"), ("cluster-c", "cluster-constraint"),
     ("cluster", "clusters"), ("tasks-per", "ntasks-per-node"), ("reserv", "reservation"), ("mem", "mem"),
     ("export-f", "export-file")],
)  # fmt: skip
def test_a_key_is_read_as_the_one_option_it_is_a_prefix_of(key, read_as):
    assert resolve_option(key, OPTIONS) == (read_as, "")


def test_a_prefix_of_several_options_and_a_key_of_none_are_refused_naming_them():
    assert resolve_option("gpu", OPTIONS)[1].startswith("--gpu is a prefix of several sbatch options (--gpu-bind, ")
    assert resolve_option("mem-per", OPTIONS)[1].startswith("--mem-per is a prefix of several sbatch options")
    assert resolve_option("reservaton", OPTIONS)[1] == "--reservaton is no sbatch option (the nearest: --reservation)"


@pytest.mark.parametrize("key", ["arr", "requeu", "no_req", "job_n", "sig", "outp", "comm", "export-", "tasks_per"])
def test_plan_refuses_a_prefix_of_an_option_hpcfsdp_sets(key, tmp_path, capsys):
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(yaml.safe_dump({"name": "p", "base": {"device": "cpu"}, "slurm": {"extra_sbatch": {key: 1}}}))
    assert main(["plan", str(jobs), "--sbatch"]) == 2
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1
    assert (
        f"slurm.extra_sbatch.{key}: --{key.replace('_', '-')} (sbatch reads it as --" in err
        and "is set by hpcfsdp" in err
    )


@pytest.mark.parametrize(
    ("key", "read_as", "why"),
    [("parsable", "parsable", "changes what sbatch prints"), ("pars", "parsable", "changes what sbatch prints"),
     ("quiet", "quiet", "changes what sbatch prints"), ("test_only", "test-only", "queues nothing"),
     ("test-o", "test-only", "queues nothing"), ("wait", "wait", "return only when the job ends"),
     ("wrap", "wrap", "replaces the batch script"), ("chd", "chdir", "moves the folder the job starts in"),
     ("ntasks", "ntasks", "changes the task layout"), ("ntasks-per-g", "ntasks-per-gpu", "changes the task layout"),
     ("version", "version", "queue nothing"), ("get-user", "get-user-env", "past the allowlist")],
)  # fmt: skip
def test_plan_refuses_sbatch_options_that_change_its_output_its_return_or_the_task_layout(
    key, read_as, why, tmp_path, capsys
):
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(f"name: p\nbase: {{device: cpu}}\nslurm:\n  extra_sbatch: {{{key}: true}}\n")
    for argv in (["plan", str(jobs)], ["submit", str(jobs), "--executor", "slurm", "--results-dir", str(tmp_path)]):
        assert main(argv) == 2
        out, err = capsys.readouterr()
        assert out == "" and err.count("\n") == 1
        written = key.replace("_", "-")
        shown = f"--{written}" if written == read_as else f"--{written} (sbatch reads it as --{read_as})"
        assert err.startswith(f"error: {jobs}:4: slurm.extra_sbatch.{key}: {shown} ") and why in err, err
        assert err.endswith("; not passed through\n")
    assert not (tmp_path / "p").exists()


def test_an_accepted_prefix_is_written_as_the_option_in_full(tmp_path, capsys):
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text(
        yaml.safe_dump({"name": "p", "base": {"device": "cpu"}, "slurm": {"extra_sbatch": {"reserv": "m"}}})
    )
    assert main(["plan", str(jobs), "--sbatch"]) == 0
    assert "#SBATCH --reservation=m" in capsys.readouterr().out


def test_on_24_11_an_option_its_help_lists_but_sbatch_rejects_is_no_option():
    # 24.11.5's --help lists --power; its sbatch answers "unrecognized option '--power'".
    listed = "Usage: sbatch [OPTIONS(0)...]\n      --power=flags  power management options\n  -p, --partition=..."
    assert "power" in options_of("slurm 22.05.8", listed)
    on_24_11 = options_of("slurm 24.11.5", listed)
    assert "power" not in on_24_11 and {"oom-kill-step", "tres-per-task", "stepmgr"} <= on_24_11
    assert resolve_option("power", on_24_11)[1].startswith("--power is no sbatch option (the nearest: ")
    assert resolve_option("power", options_of("slurm 22.05.8", listed)) == ("power", "")


@pytest.mark.slurm
def test_a_power_key_passes_plan_where_the_release_takes_it_and_is_refused_where_it_does_not(
    slurm_cluster, tmp_path, capsys
):
    """22.05's sbatch takes --power; 24.11's rejects it, though its --help lists it."""
    release = running_release()
    jobs = tmp_path / "jobs.yaml"
    jobs.write_text("name: p\nbase: {device: cpu}\nslurm:\n  extra_sbatch: {power: level}\n")
    sbatch_options.sbatch_options.cache_clear()
    try:
        code = main(["plan", str(jobs), "--sbatch"])
    finally:
        sbatch_options.sbatch_options.cache_clear()
    out, err = capsys.readouterr()
    sbatch = subprocess.run(
        ["sbatch", "--power=level", "--test-only", "--wrap=true"], capture_output=True, text=True, timeout=30
    )
    if release is not None and release >= (24, 5):
        assert code == 2 and err.startswith(f"error: {jobs}:4: slurm.extra_sbatch.power: --power is no sbatch option")
        assert "unrecognized option" in sbatch.stderr, sbatch.stderr
    else:
        assert code == 0 and "#SBATCH --power=level" in out, err
        assert "unrecognized option" not in sbatch.stderr, sbatch.stderr


@pytest.mark.slurm
def test_the_packaged_options_are_the_local_sbatchs_and_it_reads_prefixes_as_resolved(slurm_cluster):
    """On the release the local cluster runs: 22.05 (Debian 12) or 24.11 (Debian 13)."""
    sbatch_options.sbatch_options.cache_clear()
    try:
        installed = sbatch_options.sbatch_options()
    finally:
        sbatch_options.sbatch_options.cache_clear()
    packaged = release_options(running_release())
    assert installed == packaged  # its --help and --usage, and those of its release its help leaves out
    # Every packaged option is one this sbatch knows (a wrong value is fine; an unknown name is not).
    unknown = []
    for name in sorted(packaged - {"help", "usage", "version", "wait"}):
        proc = subprocess.run(
            ["sbatch", f"--{name}=x", "--test-only", "--hold", "--wrap=true"],
            capture_output=True,
            text=True,
            timeout=30,
        )
        if "unrecognized option" in proc.stderr or "ambiguous" in proc.stderr:
            unknown.append((name, proc.stderr.strip()))
    assert unknown == []
    # What the package resolves, sbatch resolves alike; what it calls ambiguous, so does sbatch.
    for key, value in (("arr", "0-1"), ("requeu", None), ("reserv", None), ("no-req", None)):
        flag = f"--{key}" if value is None else f"--{key}={value}"
        proc = subprocess.run(
            ["sbatch", flag, "--test-only", "--wrap=true"], capture_output=True, text=True, timeout=30
        )
        assert "unrecognized" not in proc.stderr and "ambiguous" not in proc.stderr, (key, proc.stderr)
    proc = subprocess.run(
        ["sbatch", "--gpu=1", "--test-only", "--wrap=true"], capture_output=True, text=True, timeout=30
    )
    assert "is ambiguous" in proc.stderr, proc.stderr
    proc = subprocess.run(["sbatch", "--reservaton=x", "--wrap=true"], capture_output=True, text=True, timeout=30)
    assert "unrecognized option" in proc.stderr, proc.stderr


def test_a_job_requeued_with_max_requeue_0_does_not_train_again(monkeypatch):
    from hpcfsdp.cell.stopping.requeue import requeued_too_often

    monkeypatch.setenv("HPCFSDP_MAX_REQUEUE", "0")
    monkeypatch.setenv("SLURM_RESTART_COUNT", "1")
    assert "above slurm.max_requeue 0: not run again" in requeued_too_often()
    monkeypatch.setenv("HPCFSDP_MAX_REQUEUE", "1")
    assert requeued_too_often() == ""
    monkeypatch.setenv("SLURM_RESTART_COUNT", "0")
    monkeypatch.setenv("HPCFSDP_MAX_REQUEUE", "0")
    assert requeued_too_often() == ""
