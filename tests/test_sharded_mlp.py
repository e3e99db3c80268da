"""The seed's quickstart (003) on 8 real processes, launched as users launch it: recipes/sharded-mlp/run.sh through
DeepSpeed's launcher, and with --launcher openmpi through a real `mpirun` (the seed's run_with_mpi.sh). Each launch
checks the loss of every step against the serial run, the same loss line on every rank, and on every rank the
local shapes of the seed's IR ((8, 8) @ (8, 16) for the first MatMul)."""

import json
import shutil

import pytest

from demos.sharded_mlp.train import MLPConfig, train_serial
from tests.launch import only_launch, only_run_dir, run_script, script_env

SEED_LINES = [  # rank-independent lines of every rank's execute.txt: the shapes of the seed's 18_execute IR
    "%matmul = MatMul(%data, %weight) {in_strategy: ((2, 4), (4, 1))} : ((8, 8), (8, 16)) -> (8, 16)",
    "%relu = ReLU(%matmul) {in_strategy: ((2, 4),)} : ((8, 4)) -> (8, 4)",
    "%matmul2 = MatMul(%relu, %weight2) {in_strategy: ((2, 4), (4, 1))} : ((8, 4), (4, 16)) -> (8, 16)",
]


def rank_logs(run_dir, launcher):
    logs = only_launch(run_dir)  # this launch: RUN/logs/<time>/
    if launcher == "openmpi":  # mpirun --output-filename: logs/1/rank.N/stdout
        return {int(p.parent.name.split(".")[1]): p.read_text() for p in logs.glob("*/rank.*/stdout")}
    return {int(p.stem.rsplit("rank", 1)[1]): p.read_text() for p in logs.glob("*_rank*.log")}


@pytest.mark.slow
@pytest.mark.parametrize("launcher", ["deepspeed", "openmpi"])
def test_seed_mlp_on_8_processes_matches_serial(launcher, tmp_path):
    if launcher == "openmpi" and shutil.which("mpirun") is None:
        pytest.skip("mpirun not found: install OpenMPI (apt-get install -y openmpi-bin) for the seed's mpirun launch")
    runs = tmp_path / "runs"
    proc = run_script("recipes/sharded-mlp/run.sh", ["--launcher", launcher], script_env(runs), timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    run_dir = only_run_dir(runs)
    got = [json.loads(line)["loss"] for line in (run_dir / "output" / "metrics.jsonl").read_text().splitlines()]
    serial = train_serial(MLPConfig())
    worst = max(abs(a - b) / abs(b) for a, b in zip(got, serial))
    print(f"STRATEGY {launcher} 8 processes: max relative loss difference to serial {worst:.2e} over {len(got)} steps")
    assert len(got) == 20 and worst <= 1e-6
    logs = rank_logs(run_dir, launcher)
    assert sorted(logs) == list(range(8))
    lines = {r: [ln for ln in text.splitlines() if ln.startswith("epoch: ")] for r, text in logs.items()}
    assert lines[0][9] == f"epoch: 3 step: 2, loss is {got[9]}"
    assert all(lines[r] == lines[0] and len(lines[r]) == 20 for r in lines)  # every rank reports the same loss
    for r in range(8):
        executed = (run_dir / "output" / f"rank_{r}" / "execute.txt").read_text().splitlines()
        assert all(line in executed for line in SEED_LINES), (r, executed)
        group = "[0-3]" if r < 4 else "[4-7]"
        assert f"    AllReduce (8, 16) over ranks {group}  all_reduce ×1" in executed
        # the inputs' (2, 32) rows → (8, 8) blocks: an all-gather on gloo (no all-to-all there)
        assert f"    %data: (2, 32) -> (8, 8)  all_gather ×1 over ranks {group}" in executed
        assert (run_dir / "output" / f"rank_{r}" / "step_parallel_begin.txt").is_file()
