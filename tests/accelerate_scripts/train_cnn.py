"""Run under ``accelerate launch`` by tests/adapters/test_accelerate.py: train the test CNN for a few
steps, plain and with the swap plugin (switched on by the environment and in code), and
save what each run produced for the test to compare.

Usage: accelerate launch [...] train_cnn.py OUT_DIR

Writes OUT_DIR/<run>.rank<r>.pt (the trained state_dict) and OUT_DIR/report.rank<r>.json.
The environment it is launched with is the first swap run's configuration (it proves
``accelerate launch`` passes ACCELERATE_CPU_SWAP* through); later runs change
``os.environ`` in this process, before each accelerator is built.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository root, for `tests`

import torch  # noqa: E402
from accelerate import Accelerator  # noqa: E402
from accelerate.tracking import GeneralTracker  # noqa: E402
from accelerate.utils import set_seed  # noqa: E402
from torch.nn import functional as F  # noqa: E402
from torch.utils.data import DataLoader, TensorDataset  # noqa: E402

from accelerate_swap import SwapAccelerator, SwapPlugin  # noqa: E402
from tests.helpers import POLICIES  # noqa: E402
from tests.models import CNN, MODELS  # noqa: E402

STEPS = 3
BATCH = 4


class RecordingTracker(GeneralTracker):
    """Keeps what ``accelerator.log`` sends it."""

    name = "recording"
    requires_logging_directory = False

    def __init__(self) -> None:
        super().__init__()
        self.logged: list[tuple[int, dict]] = []

    @property
    def tracker(self):
        return self.logged

    def log(self, values, step=None, **kwargs):
        self.logged.append((step, dict(values)))


def module_state(model: torch.nn.Module) -> dict:
    """What must be back to normal once the plugin is gone."""
    return {
        "forward_attrs": sorted(n for n, m in model.named_modules() if "forward" in m.__dict__),
        "pre_hooks": sum(len(m._forward_pre_hooks) for m in model.modules()),
        "hooks": sum(len(m._forward_hooks) for m in model.modules()),
        "saved_tensors_hooks": torch._C._autograd._top_saved_tensors_default_hooks(False) is not None,
        "keys": list(model.state_dict()),
    }


def train(accelerator: Accelerator, out: Path, run: str, *, close: str = "free_memory") -> dict:
    set_seed(0)  # model init and dropout masks: the same in every run
    model = CNN()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    x, y = MODELS["cnn"][1](BATCH * STEPS * accelerator.num_processes)
    loader = DataLoader(TensorDataset(x, y), batch_size=BATCH, shuffle=False)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    inner = accelerator.unwrap_model(model)
    report: dict = {
        "distributed_type": str(accelerator.distributed_type.value),
        "num_processes": accelerator.num_processes,
        "wrapper": type(model).__name__,
    }
    plan = getattr(accelerator, "swap_plan", None)
    report["plan"] = None if plan is None else {k: a.value for k, a in plan.actions.items()}
    report["during"] = module_state(inner)
    stats = []
    model.train()
    for step, (xb, yb) in enumerate(loader):
        if step == STEPS:
            break
        loss = F.cross_entropy(model(xb), yb)
        accelerator.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        s = getattr(accelerator, "swap_step_stats", None)
        stats.append(None if s is None else s.as_metrics())
    report["stats"] = stats
    plan = getattr(accelerator, "swap_plan", None)  # with policy="auto", made in the first forward
    report["final_plan"] = None if plan is None else {k: a.value for k, a in plan.actions.items()}
    report["final_predicted_peak"] = None if plan is None else plan.predicted_peak_bytes
    trackers = getattr(accelerator, "trackers", [])
    report["logged"] = [[step, sorted(values)] for t in trackers if isinstance(t, RecordingTracker) for step, values in t.logged]
    torch.save({k: v.detach().clone() for k, v in inner.state_dict().items()}, out / f"{run}.rank{accelerator.process_index}.pt")
    session = getattr(accelerator, "swap_session", None)
    if session is not None:
        # no window opens without autograd or in eval mode (Note [Hooked step window]);
        # after the state is saved, since a no-grad forward in train mode moves BatchNorm stats
        model.eval()
        model(xb)
        model.train()
        with torch.no_grad():
            model(xb)
        report["eval_opened_window"] = session.runtime.measuring
    if close == "session":
        session.close()
        report["swap_session_after_close"] = accelerator.swap_session is not None
    else:
        accelerator.free_memory()
    report["after"] = module_state(inner)
    # the model still trains without the plugin
    loss = F.cross_entropy(model(xb), yb)
    loss.backward()
    return report


def main() -> None:
    out = Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    reports: dict = {}
    launched = {k: v for k, v in os.environ.items() if k.startswith("ACCELERATE_CPU_SWAP")}

    def set_env(values: dict) -> None:
        for key in [k for k in os.environ if k.startswith("ACCELERATE_CPU_SWAP")]:
            del os.environ[key]
        os.environ.update(values)

    reports["plain"] = train(Accelerator(cpu=True), out, "plain")

    # the switch as launched: on, policy from the launching environment
    acc = SwapAccelerator(cpu=True)
    reports["launched"] = train(acc, out, "launched")
    reports["launched"]["env"] = launched

    set_env({"ACCELERATE_CPU_SWAP": "false", "ACCELERATE_CPU_SWAP_POLICY": "offload"})
    acc = SwapAccelerator(cpu=True)
    reports["off"] = train(acc, out, "off")
    reports["off"]["plugin"] = repr(acc.swap_plugin)

    for policy in POLICIES:
        set_env({"ACCELERATE_CPU_SWAP": "true", "ACCELERATE_CPU_SWAP_POLICY": policy, "ACCELERATE_CPU_SWAP_MIN_OFFLOAD_BYTES": "0"})
        acc = SwapAccelerator(cpu=True, log_with=[RecordingTracker()])
        acc.init_trackers("swap-test")
        reports[policy] = train(acc, out, policy)

    # policy="auto" under a simulated budget: 60% of the plain (keep) run's peak
    budget = int(0.6 * max(st["swap/peak_device_bytes"] for st in reports["keep"]["stats"]))
    set_env({
        "ACCELERATE_CPU_SWAP": "true",
        "ACCELERATE_CPU_SWAP_POLICY": "auto",
        "ACCELERATE_CPU_SWAP_BUDGET_BYTES": str(budget),
        "ACCELERATE_CPU_SWAP_MIN_OFFLOAD_BYTES": "0",
    })
    reports["auto"] = train(SwapAccelerator(cpu=True), out, "auto")
    reports["auto"]["budget"] = budget

    set_env({})
    plugin = SwapPlugin(policy={"blocks.0": "offload", "blocks.2": "recompute_offload"}, min_offload_bytes=0)
    reports["code"] = train(SwapAccelerator(cpu=True, swap_plugin=plugin), out, "code", close="session")

    (out / f"report.rank{acc.process_index}.json").write_text(json.dumps(reports, indent=1))
    acc.end_training()


if __name__ == "__main__":
    main()
