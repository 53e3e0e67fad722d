import gc
import os

import pytest

# Tests never talk to a W&B server.
os.environ.setdefault("WANDB_MODE", "disabled")
os.environ.setdefault("WANDB_SILENT", "true")


@pytest.fixture(autouse=True)
def _one_thread():
    import torch

    torch.set_num_threads(1)
    torch.set_flush_denormal(True)
    yield


def pytest_addoption(parser):
    parser.addoption(
        "--layout-matrix", choices=("ci", "all"), default="ci",
        help="layout-equivalence cases to run: the CI sample (default) or the whole generated matrix",
    )
    parser.addoption(
        "--extended", action="store_true",
        help="also run tests marked `extended` (costly repeats of behaviour CI covers more cheaply)",
    )
    parser.addoption(
        "--dryrun-seeds", default=None, metavar="A:B",
        help="tests/test_dryrun_fuzz.py: also run the widened drawn layouts A..B-1 (tests/dryrun_fuzz.seed_range)",
    )


class NoSilentSkips:
    """A skipped test fails the run: a missing dev dependency (transformers, megatron-core, triton,
    matplotlib) or a premise a machine does not meet must not pass as green."""

    def __init__(self) -> None:
        self.skipped: list[str] = []

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if report.skipped:
            self.skipped.append(report.nodeid)

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.skipped and session.exitstatus == pytest.ExitCode.OK:
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.skipped:
            terminalreporter.write_line(f"{len(self.skipped)} skipped test(s) fail this run (no silent skips): "
                                        + ", ".join(self.skipped), red=True)


def pytest_configure(config):
    config.pluginmanager.register(NoSilentSkips(), "no-silent-skips")


def pytest_collection_modifyitems(config, items):
    """`extended` tests are deselected unless --extended: CI stays under 15 minutes on 2 cores."""
    if config.getoption("--extended"):
        return
    keep = [item for item in items if item.get_closest_marker("extended") is None]
    if len(keep) < len(items):
        config.hook.pytest_deselected(items=[item for item in items if item.get_closest_marker("extended")])
        items[:] = keep


def pytest_collection_finish(session):
    """The collected items and everything imported live until the session ends: frozen out of the cyclic
    collector's sight, its full collections walk only what the tests create (session 47, test_model_shape +
    test_zb_memory in one process: 3.0 -> 2.3 s of 24 s CPU in the collector; the rank workers do the same,
    tests/harness.py)."""
    gc.freeze()


def pytest_unconfigure(config):
    # Back in sight for the interpreter's last collection, so extension types see their objects freed at exit.
    gc.unfreeze()
