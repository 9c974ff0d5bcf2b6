from pathlib import Path

from shardflow.runtime import checkpointing as ckpt


def write(out: Path, iteration: int, complete: bool, keep: int = 2) -> None:
    staging = ckpt.begin(out, iteration)
    (staging / "state.json").write_text(str(iteration))
    if complete:
        ckpt.commit(out, iteration, keep)


def test_interrupted_save_leaves_previous_checkpoint(tmp_path):
    assert ckpt.latest(tmp_path) is None
    write(tmp_path, 1, complete=True)
    write(tmp_path, 2, complete=False)  # killed before commit
    assert ckpt.latest(tmp_path).name == "iter-000001"
    assert (ckpt.latest(tmp_path) / "state.json").read_text() == "1"
    write(tmp_path, 3, complete=True)  # the next save removes the stale staging directory
    assert ckpt.latest(tmp_path).name == "iter-000003"
    assert not list(ckpt.checkpoint_root(tmp_path).glob("tmp-*"))


def test_keeps_only_recent_checkpoints(tmp_path):
    for i in range(1, 5):
        write(tmp_path, i, complete=True, keep=2)
    names = sorted(p.name for p in ckpt.checkpoint_root(tmp_path).glob("iter-*"))
    assert names == ["iter-000003", "iter-000004"] and ckpt.iteration_of(ckpt.latest(tmp_path)) == 4
