"""Shared test setup: `gpu`-marked tests are skipped where no CUDA/ROCm GPU is visible; fixtures
several files use (`make_ring`, `tok`: the embedded SmolLM2 tokenizer, `smollm2_hf`: transformers' own
load of the embedded SmolLM2 GGUF, fp32; about 30 s, so loaded once for the session and never modified;
`smol_server`: a `rapidserve serve` of the embedded SmolLM2 with the default flags, one per test process)."""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Callable, Iterator
from typing import Any

# Python's bytecode caches on for the run and every process it starts, before anything below imports rapidserve:
# under PYTHONDONTWRITEBYTECODE=1 (set in some CI images, and on the helpers' machine) nothing is ever cached, so
# every server, engine fork server, CLI and interpreter-check subprocess the suite starts compiles rapidserve's ~150
# modules from source again (about 1.2 CPU-s a process; tests/test_cli.py + test_server.py: 56.8 -> 51.7 CPU-s), and
# pytest rewrites every test module's asserts at each collection (18 CPU-s with its cache, 50 without; in one
# clean run the two workers collect at once, so that part pays off only on a rerun). The caches go to __pycache__/
# (git-ignored).
sys.dont_write_bytecode = False
os.environ.pop("PYTHONDONTWRITEBYTECODE", None)

import pytest  # noqa: E402
import torch  # noqa: E402

from rapidserve.ipc import ShmRing, new_engine_id, ring_name  # noqa: E402
from rapidserve.loader import resolve_model  # noqa: E402
from rapidserve.tokenizer import Tokenizer  # noqa: E402
from tests.run_order import longest_first  # noqa: E402

# Helper modules whose asserts should explain themselves like a test's (pytest rewrites only test files).
pytest.register_assert_rewrite("tests.decode_sched_fakes", "tests.server_fakes")

# One compute thread in each test process and in the processes it starts (unless OMP_NUM_THREADS says otherwise):
# beside the engine workers a test runs (one thread each on 2 cores) and the other pytest-xdist worker, OpenMP
# threads outnumber the free cores and spin at every barrier. Measured on 2 loaded cores, SmolLM2 greedy in two
# processes at once: 45 s and 29 s of CPU each at 2 threads, 13 s and 7 s at 1. The engine's workers set their
# own count (rapidserve/engine/worker_build.py) whatever this says.
os.environ.setdefault("OMP_NUM_THREADS", "1")
torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def _has_gpu() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


_LOGGERS = ("", "rapidserve", "rapidserve.requests", "aiohttp.access", "aiohttp.server", "aiohttp.web",
            "aiohttp.internal")


@pytest.fixture(autouse=True)
def _logging_as_it_was() -> Iterator[None]:
    """A test that configures logging in-process (`configure_logging`, a worker's log setup) leaves the
    levels and root handlers as it found them, so a later test's caplog sees every record it forces."""
    levels = {name: logging.getLogger(name).level for name in _LOGGERS}
    handlers = list(logging.getLogger().handlers)
    yield
    for name, level in levels.items():
        logging.getLogger(name).setLevel(level)
    root = logging.getLogger()
    for h in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(h)


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("dist", "no") in ("loadfile", "loadscope"):  # pytest-xdist's controller, handing out files:
        config.option.loadscopereorder = False  # in the workers' order (tests/run_order.py), not by number of tests


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    if hasattr(config, "workerinput"):  # a pytest-xdist worker: its collection is the order the controller hands out
        items[:] = longest_first(items)
    if _has_gpu():
        return
    skip = pytest.mark.skip(reason="needs a CUDA or ROCm GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


MakeRing = Callable[..., ShmRing]


@pytest.fixture
def make_ring() -> Iterator[MakeRing]:
    """Rings created by a test, always closed and unlinked afterwards."""
    rings: list[ShmRing] = []

    def make(slots: int = 8, slot_size: int = 64, **kw: Any) -> ShmRing:
        ring = ShmRing.create(ring_name(new_engine_id(), "test"), slots, slot_size, **kw)
        rings.append(ring)
        return ring

    yield make
    for ring in rings:
        ring.close()
        ring.unlink()


@pytest.fixture(scope="session")
def smollm2_hf(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """transformers' AutoModelForCausalLM of the embedded SmolLM2 GGUF (dequantized, fp32, eval mode).
    Shared: tests must only run it, never change its weights or settings.

    transformers reads the GGUF once per test run: it parses the file's metadata in Python (about 30 s). Under
    pytest-xdist the first worker to need it also writes what it read (config and fp32 weights, safetensors: the
    same numbers) to the run's shared temporary folder, and the others load that (under a second)."""
    import json

    from filelock import FileLock
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    from rapidserve.loader import default_gguf_path

    def from_gguf() -> Any:
        path = default_gguf_path()
        return AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                    dtype=torch.float32).eval()

    if "PYTEST_XDIST_WORKER" not in os.environ:
        return from_gguf()
    shared = tmp_path_factory.getbasetemp().parent / "smollm2_hf"  # the workers' base folders share this parent
    with FileLock(f"{shared}.lock"):
        if (shared / "model.safetensors").exists():
            return AutoModelForCausalLM.from_pretrained(shared, dtype=torch.float32).eval()
        model = from_gguf()
        config = model.config.to_dict()
        config.pop("quantization_config")  # where it came from (GGUF); the weights written are plain fp32
        tied = model.config.tie_word_embeddings
        shared.mkdir(exist_ok=True)
        (shared / "config.json").write_text(json.dumps(config))
        save_file({k: v.contiguous() for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")},
                  str(shared / "model.safetensors.part"), metadata={"format": "pt"})
        (shared / "model.safetensors.part").rename(shared / "model.safetensors")
        return model


@pytest.fixture(scope="session")
def smol_server() -> Iterator[Any]:
    """`rapidserve serve` of the embedded SmolLM2 with the default flags (tests/test_server.py's `start()`: CPU,
    --max-model-len 1024, rapid mode, both workers), started once per test process (per pytest-xdist worker)
    for the files that need exactly that server, instead of one per file (a start is about 15 CPU-s on 2 cores).
    Its users only send it requests, each test's answers independent of what came before (no absolute counter
    or cache-hit checks, no signals, no killed workers, nothing left running after a test); a test that needs
    other flags or fresh state starts its own. Stopped with SIGTERM at the end: it drains and exits 0."""
    from tests.test_server import start, stop

    s = start()
    yield s
    assert stop(s) == 0


@pytest.fixture(scope="module")
def tok() -> Tokenizer:
    """The embedded default model's tokenizer (SmolLM2)."""
    t = Tokenizer.from_source(resolve_model(None))
    assert t is not None
    return t
