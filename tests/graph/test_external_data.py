"""A model file is untrusted input: every path it names stays inside its folder, nothing is resolved
against the working directory, saves never write through links, loads race saves safely, and
killed saves leave nothing behind."""

from __future__ import annotations

import json
import os
import shutil
import signal
import stat
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import placement as pl
from placement.graph import atomic, loading, save_guard
from placement.graph.atomic import write_atomic
from placement.graph.saving import DATA_CHECK_KEY
from tests.graph.builders import mlp_graph

# --- watching which files Python opens (sys.addaudithook cannot be removed: gate it) --------

_OPENED: list[str] | None = None


def _audit(event: str, args: tuple) -> None:
    if _OPENED is not None and event == "open" and args and isinstance(args[0], (str, bytes, os.PathLike)):
        _OPENED.append(os.path.abspath(os.fsdecode(args[0])))


sys.addaudithook(_audit)


class _Opens:
    def __enter__(self) -> list[str]:
        global _OPENED
        _OPENED = []
        return _OPENED

    def __exit__(self, *exc: object) -> None:
        global _OPENED
        _OPENED = None


def _matmul_model(folder: Path, weight: np.ndarray, *, location: str = "w.bin") -> Path:
    """y = x @ w with ``w`` (2x2 float32, 16 bytes: under the inline threshold) in an external file."""
    folder.mkdir(parents=True, exist_ok=True)
    (folder / location).write_bytes(weight.astype(np.float32).tobytes())
    w = TensorProto(name="w", data_type=TensorProto.FLOAT, dims=[2, 2])
    w.data_location = TensorProto.EXTERNAL
    for key, value in (("location", location), ("offset", "0"), ("length", "16")):
        entry = w.external_data.add()
        entry.key, entry.value = key, value
    graph = helper.make_graph(
        [helper.make_node("MatMul", ["x", "w"], ["y"], name="mm")],
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 2])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 2])],
        initializer=[w],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    path = folder / "m.onnx"
    path.write_bytes(model.SerializeToString())
    return path


# --- 1. small external tensors are read from the model's folder, not the working directory ---


def test_small_external_weight_is_read_from_the_model_folder_not_the_working_directory(tmp_path, monkeypatch):
    path = _matmul_model(tmp_path / "model", np.eye(2))
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "w.bin").write_bytes((7 * np.eye(2, dtype=np.float32)).tobytes())  # the planted file
    monkeypatch.chdir(elsewhere)
    x = np.arange(4, dtype=np.float32).reshape(2, 2)
    with _Opens() as opened:
        model = pl.load(path)
        (y,) = pl.run(model, {"x": x})
    np.testing.assert_array_equal(y, x)  # identity: the model's own w.bin, not 7x identity
    assert not [p for p in opened if p.startswith(str(elsewhere))]
    module = pl.to_torch(model, device_map="cpu")
    np.testing.assert_array_equal(module(__import__("torch").from_numpy(x)).detach().numpy(), x)


def test_small_external_weight_works_from_any_working_directory(tmp_path, monkeypatch):
    path = _matmul_model(tmp_path / "model", 2 * np.eye(2))
    (tmp_path / "cwd").mkdir()
    monkeypatch.chdir(tmp_path / "cwd")  # no w.bin here: ORT used to fail ("escapes working directory")
    x = np.ones((2, 2), np.float32)
    np.testing.assert_array_equal(pl.run(pl.load(path), {"x": x})[0], 2 * x)


@pytest.mark.skipif(shutil.which("strace") is None, reason="needs strace")
def test_no_file_outside_the_model_folder_is_opened_by_onnx_runtime(tmp_path):
    """Under strace: no relative open, and nothing in the working directory, while loading and running."""
    path = _matmul_model(tmp_path / "model", np.eye(2))
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    (cwd / "w.bin").write_bytes((7 * np.eye(2, dtype=np.float32)).tobytes())
    script = textwrap.dedent(
        f"""
        import numpy as np, placement as pl
        model = pl.load({str(path)!r})
        open("START-MARK", "w").close()
        y = pl.run(model, {{"x": np.ones((2, 2), np.float32)}})[0]
        assert (y == 1).all(), y
        """
    )
    log = tmp_path / "trace.txt"
    done = subprocess.run(
        [
            "strace",
            "-f",
            "--seccomp-bpf",
            "-e",
            "trace=open,openat,openat2",
            "-o",
            str(log),
            sys.executable,
            "-c",
            script,
        ],
        cwd=cwd,
        capture_output=True,
        text=True,
        timeout=120,
    )
    if "ptrace" in done.stderr or "Operation not permitted" in done.stderr:
        pytest.skip(f"strace cannot trace here: {done.stderr.strip()[:200]}")
    assert done.returncode == 0, done.stderr
    text = log.read_text()
    after = text[text.index("START-MARK") :]
    opened = [line.split('"')[1] for line in after.splitlines() if '"' in line and "ENOENT" not in line]
    assert "w.bin" not in opened and str(cwd / "w.bin") not in opened, opened


# --- 2. the data-pairing metadata is confined like every external data location -----------


def _saved_with_data(folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "m.onnx"
    mlp_graph(width=16).save(path, external_data=True)
    return path


def _set_pairing(path: Path, spec: str) -> None:
    proto = onnx.load(str(path), load_external_data=False)
    entries = {p.key: p for p in proto.metadata_props}
    entries[DATA_CHECK_KEY].value = spec
    path.write_bytes(proto.SerializeToString())


def test_pairing_metadata_outside_the_folder_is_refused_without_opening_it(tmp_path):
    path = _saved_with_data(tmp_path / "model")
    outside = tmp_path / "secret.data"
    outside.write_bytes(b"secret")
    for spec in ("../secret.data:00", f"{outside}:00", "/etc/passwd:00"):
        _set_pairing(path, spec)
        with _Opens() as opened, pytest.raises(pl.ModelLoadError, match="outside the model's folder"):
            pl.load(path)
        assert not [p for p in opened if not p.startswith(str(path.parent))], (spec, opened)


def test_pairing_refusal_does_not_tell_whether_an_outside_file_exists(tmp_path):
    path = _saved_with_data(tmp_path / "model")
    messages = []
    for name in ("/etc/passwd", "/no/such/file"):
        _set_pairing(path, f"{name}:00")
        with pytest.raises(pl.ModelLoadError) as info:
            pl.load(path)
        messages.append(str(info.value).replace(name, "NAME"))
    assert messages[0] == messages[1]


def test_pairing_through_a_link_out_of_the_folder_is_refused(tmp_path):
    path = _saved_with_data(tmp_path / "model")
    (tmp_path / "outside.data").write_bytes(b"x" * 64)
    os.symlink(tmp_path / "outside.data", path.parent / "link.data")
    _set_pairing(path, "link.data:00")
    with _Opens() as opened, pytest.raises(pl.ModelLoadError, match="outside the model's folder"):
        pl.load(path)
    assert str(tmp_path / "outside.data") not in opened


@pytest.mark.parametrize("where", ["fifo", "stdin"])
def test_pairing_metadata_naming_a_fifo_fails_at_once(tmp_path, where):
    path = _saved_with_data(tmp_path / "model")
    fifo = path.parent / "pipe.data"
    os.mkfifo(fifo)
    _set_pairing(path, "pipe.data:00" if where == "fifo" else "/dev/stdin:00")
    result: list[BaseException | None] = []

    def load() -> None:
        try:
            pl.load(path)
            result.append(None)
        except BaseException as err:  # noqa: BLE001 (reported below)
            result.append(err)

    worker = threading.Thread(target=load, daemon=True)
    worker.start()
    worker.join(10)
    if worker.is_alive():  # unblock the reader before failing
        fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)
        os.close(fd)
        worker.join(5)
        pytest.fail("loading hung on a FIFO named by the model's metadata")
    assert isinstance(result[0], pl.ModelLoadError), result


# --- 4. saving never writes through a link out of the output folder ---------------------------


def test_save_replaces_a_link_instead_of_writing_through_it(tmp_path):
    out, elsewhere = tmp_path / "out", tmp_path / "elsewhere"
    out.mkdir()
    elsewhere.mkdir()
    victim = elsewhere / "victim.txt"
    victim.write_text("precious")
    victim.chmod(0o600)
    link = out / "model.onnx"
    os.symlink(os.path.relpath(victim, out), link)
    model = mlp_graph()
    model.save(link)
    assert victim.read_text() == "precious" and stat.S_IMODE(victim.stat().st_mode) == 0o600
    assert not link.is_symlink() and link.is_file()
    assert pl.load(link).devices == model.devices


def test_save_through_a_dangling_link_creates_nothing_elsewhere(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    target = tmp_path / "elsewhere" / "new.onnx"
    target.parent.mkdir()
    os.symlink(target, out / "model.onnx")
    mlp_graph().save(out / "model.onnx", external_data=True)
    assert not os.path.lexists(target) and os.listdir(target.parent) == []
    assert (out / "model.onnx").is_file() and not (out / "model.onnx").is_symlink()


def test_save_follows_a_link_only_when_asked(tmp_path):
    real = tmp_path / "real.onnx"
    real.write_bytes(b"old")
    os.symlink(real, tmp_path / "link.onnx")
    mlp_graph().save(tmp_path / "link.onnx", follow_symlinks=True)
    assert (tmp_path / "link.onnx").is_symlink()
    pl.load(real)


def test_write_atomic_replaces_a_link_instead_of_writing_through_it(tmp_path):
    victim = tmp_path / "victim.txt"
    victim.write_text("precious")
    os.symlink(victim, tmp_path / "plan.json")
    write_atomic(tmp_path / "plan.json", b"{}")
    assert victim.read_text() == "precious" and (tmp_path / "plan.json").read_text() == "{}"
    write_atomic(tmp_path / "link2", b"x")  # no link: a plain write
    os.symlink(victim, tmp_path / "link3")
    write_atomic(tmp_path / "link3", b"new", follow_symlinks=True)
    assert victim.read_text() == "new"


# --- 5. a load racing a save sees the old pair or the new one, never a raw error -------------


def test_load_rereads_when_a_save_replaces_the_pair_while_it_is_read(tmp_path, monkeypatch):
    path = tmp_path / "m.onnx"
    old, new = mlp_graph(width=16), mlp_graph(width=16)
    weight = "fc0.weight"
    new.graph.initializers[weight].const_value = pl_tensor(np.full((16, 16), 3.0, np.float32), weight)
    old.save(path, external_data=True)
    original = loading._check_external_data
    raced = []

    def check_then_race(proto, where):
        if not raced:  # a concurrent save lands between the parse and the checks
            raced.append(True)
            new.save(path, external_data=True)
        return original(proto, where)

    monkeypatch.setattr(loading, "_check_external_data", check_then_race)
    loaded = pl.load(path)
    assert raced
    np.testing.assert_array_equal(loaded.graph.initializers[weight].const_value.numpy(), 3.0)


def test_load_checks_the_model_it_parsed_not_the_file_again(tmp_path, monkeypatch):
    path = tmp_path / "m.onnx"
    mlp_graph().save(path)
    original = loading._check_external_data
    replaced = []

    def check_then_clobber(proto, where):
        if not replaced:
            replaced.append(True)
            path.write_bytes(b"\x08\x07garbage that onnx.checker would choke on")
        return original(proto, where)

    monkeypatch.setattr(loading, "_check_external_data", check_then_clobber)
    model = pl.load(path)  # the parsed (valid) model, whatever the file holds now
    assert replaced and model.graph.num_nodes() == 6


def test_concurrent_save_and_load_never_mix_or_raise(tmp_path):
    path = tmp_path / "m.onnx"
    models = [mlp_graph(width=8), mlp_graph(width=8)]
    models[1].graph.initializers["fc0.weight"].const_value = pl_tensor(
        np.ones((8, 8), np.float32), "fc0.weight"
    )
    models[0].save(path)
    want = [m.graph.initializers["fc0.weight"].const_value.numpy() for m in models]
    stop = threading.Event()
    saves = [0]

    def saver() -> None:
        while not stop.is_set():
            models[saves[0] % 2].save(path, external_data=saves[0] % 3 == 0)
            saves[0] += 1

    worker = threading.Thread(target=saver)
    worker.start()
    errors: list[BaseException] = []
    deadline = time.monotonic() + 2.0
    loads = 0
    try:
        while time.monotonic() < deadline:
            try:
                got = pl.load(path)
                w = got.graph.initializers["fc0.weight"].const_value.numpy()
            except pl.ModelLoadError as err:
                errors.append(err)
                continue
            except FileNotFoundError:  # a lazily read weight whose data file a later save retired
                continue
            except Exception as err:  # noqa: BLE001 (a raw exception is the failure)
                errors.append(err)
                continue
            loads += 1
            assert any(np.array_equal(w, x) for x in want)
    finally:
        stop.set()
        worker.join()
    assert loads > 10 and saves[0] > 10
    assert not errors, errors[:3]


def pl_tensor(array: np.ndarray, name: str):
    import onnx_ir as ir

    return ir.tensor(array, name=name)


# --- 6. killed saves leave no temporary folders for long ------------------------------------


def test_next_save_removes_temporaries_of_dead_saves_only(tmp_path):
    dead = tmp_path / ".placement-save-999999999-12345-abcd"  # no such pid
    dead.mkdir()
    (dead / "m.onnx").write_bytes(b"x" * 1000)
    live = tmp_path / f".placement-save-{os.getppid()}-{atomic._start_time(os.getppid())}-efgh"
    live.mkdir()
    reused = tmp_path / f".placement-save-{os.getppid()}-1-ijkl"  # the pid lives, but started at another time
    reused.mkdir()
    old_style = tmp_path / ".placement-save-k2j3h4"
    old_style.mkdir()
    os.utime(old_style, (time.time() - 7200, time.time() - 7200))
    young_old_style = tmp_path / ".placement-save-x9y8z7"
    young_old_style.mkdir()
    mlp_graph().save(tmp_path / "m.onnx")
    left = sorted(p.name for p in tmp_path.iterdir() if p.name.startswith(".placement-save-"))
    assert left == sorted([live.name, young_old_style.name])
    assert atomic.clean_stale_temporaries(tmp_path) == []


#: Where a SIGTERM lands during a save: the guard's named points (placement.graph.save_guard),
#: and two calls the earlier code left unguarded (the folder made before the handler was
#: installed; the handler restored before the folder was removed).
SIGTERM_POINTS = (
    "installing",
    "installed",
    "creating",
    "created",
    "dropping",
    "dropped",
    "restoring",
    "restored",
    "call:mkdir",
    "call:rmtree",
)

_SIGTERM_SCRIPT = """
import json, os, shutil, signal, sys, threading
from pathlib import Path
import numpy as np
import onnx_ir as ir
import placement as pl
from placement.graph import save_guard
from tests.graph.builders import mlp_graph

base, points = Path(sys.argv[1]), sys.argv[2:]
old, new = mlp_graph(width=16), mlp_graph(width=16)
weight = new.graph.initializers["fc0.weight"]
weight.const_value = ir.tensor(weight.const_value.numpy() * 2, name="fc0.weight")
real_mkdir, real_rmtree = os.mkdir, shutil.rmtree

def first(model):
    return model.graph.initializers["fc0.weight"].const_value.numpy()

def term():
    os.kill(os.getpid(), signal.SIGTERM)

def arm(point, folder):
    if point == "thread":  # a save in another thread is in flight when the main one is hit
        started = threading.Event()
        def hook(at):
            if threading.current_thread() is threading.main_thread():
                if at == "created":
                    threading.Thread(target=new.save, args=(folder / "other.onnx",), daemon=True).start()
                    started.wait(30)
                    term()
            elif at == "created":
                started.set()
                threading.Event().wait()  # never finishes
        save_guard._hook = hook
    elif point == "call:mkdir":
        def mkdir(path, *args, **kwargs):
            real_mkdir(path, *args, **kwargs)
            if ".placement-save-" in str(path):
                term()
        os.mkdir = mkdir
    elif point == "call:rmtree":
        def rmtree(path, *args, **kwargs):
            if ".placement-save-" in str(path):
                term()
            real_rmtree(path, *args, **kwargs)
        shutil.rmtree = rmtree
    else:
        save_guard._hook = lambda at: term() if at == point else None

results = {}
for point in points:
    folder = base / point.replace(":", "-")
    folder.mkdir()
    old.save(folder / "m.onnx", external_data=True)
    pid = os.fork()
    if pid == 0:
        try:
            arm(point, folder)
            new.save(folder / "m.onnx", external_data=True)
        finally:
            os._exit(3)  # the save finished (or failed) and SIGTERM did not end the process
    _, status = os.waitpid(pid, 0)
    left = sorted(p.name for p in folder.iterdir() if p.name.startswith(".placement-save-"))
    got = pl.load(folder / "m.onnx")
    which = [k for k, m in (("old", old), ("new", new)) if np.array_equal(first(got), first(m))]
    signalled = os.WTERMSIG(status) if os.WIFSIGNALED(status) else -os.WEXITSTATUS(status)
    results[point] = [signalled, left, which]
print(json.dumps(results))
"""


def test_sigterm_at_every_point_of_a_save_leaves_no_temporary_folder(tmp_path):
    """A SIGTERM delivered at each point of a save (hooks, no sleeping): the process ends by
    SIGTERM, no ``.placement-save-*`` folder stays (also of a save in flight in another thread),
    and the target is a whole model, the old or the new one. One interpreter, one fork per point."""
    root = Path(__file__).resolve().parents[2]
    points = [*SIGTERM_POINTS, "thread"]
    done = subprocess.run(
        [sys.executable, "-c", _SIGTERM_SCRIPT, str(tmp_path), *points],
        cwd=root,
        capture_output=True,
        text=True,
        timeout=120,
        env={**os.environ, "PYTHONPATH": str(root)},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    results = json.loads(done.stdout.strip().splitlines()[-1])
    for point in points:
        signalled, left, which = results[point]
        assert (point, signalled, left) == (point, signal.SIGTERM, []), done.stderr[-2000:]
        assert len(which) == 1, (point, which)
    assert results["installing"][2] == ["old"] and results["restored"][2] == ["new"]
    assert not list(tmp_path.glob("*/.placement-save-*"))


def test_save_guard_installs_only_over_the_default_action_and_restores_it(tmp_path):
    """Main thread with SIGTERM's default action: the guard's handler is in place during the
    save and the default is back after it; a handler of the program is left alone, and a save
    in another thread installs nothing."""
    model = mlp_graph(width=16)
    seen: list[tuple[str, object]] = []
    save_guard._hook = lambda at: seen.append((at, signal.getsignal(signal.SIGTERM)))
    mine = lambda *_: None  # noqa: E731
    try:
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        model.save(tmp_path / "a.onnx")
        handlers = dict(seen)
        assert handlers["installing"] is signal.SIG_DFL and handlers["restored"] is signal.SIG_DFL
        assert handlers["created"] is handlers["dropped"] is save_guard._on_sigterm
        assert signal.getsignal(signal.SIGTERM) is signal.SIG_DFL
        seen.clear()
        signal.signal(signal.SIGTERM, mine)
        model.save(tmp_path / "b.onnx")
        assert {at for at, _ in seen} == {"creating", "created", "dropping", "dropped"}
        assert all(handler is mine for _, handler in seen) and signal.getsignal(signal.SIGTERM) is mine
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        seen.clear()
        worker = threading.Thread(target=model.save, args=(tmp_path / "c.onnx",))
        worker.start()
        worker.join()
        assert [at for at, _ in seen] == ["creating", "created", "dropping", "dropped"]
    finally:
        save_guard._hook = None
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a.onnx", "b.onnx", "c.onnx"]


# --- 11. nodes out of topological order are sorted on load ---------------------------------


def test_unsorted_graph_loads_sorted_and_runs_the_same(tmp_path, caplog):
    nodes = [
        helper.make_node("Relu", ["a"], ["y"], name="relu"),
        helper.make_node("Add", ["x", "b"], ["a"], name="add"),
    ]
    graph = helper.make_graph(
        nodes,
        "g",
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 3])],
        initializer=[numpy_helper.from_array(np.array([-1, 0, 1], np.float32), "b")],
    )
    proto = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
    path = tmp_path / "unsorted.onnx"
    path.write_bytes(proto.SerializeToString())
    import onnxruntime as ort

    x = np.random.default_rng(0).standard_normal((2, 3)).astype(np.float32)
    want = ort.InferenceSession(str(path), providers=["CPUExecutionProvider"]).run(None, {"x": x})[0]
    with caplog.at_level("INFO", logger="placement"):
        model = pl.load(path)
    assert [op.name for op in model.ops] == ["add", "relu"]
    assert not [r for r in caplog.records if r.levelname != "DEBUG" and "topological" in r.message]
    pl.verify(model)
    np.testing.assert_allclose(pl.run(model, {"x": x})[0], want)
