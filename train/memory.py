"""`python -m train.memory [data=imagenet] [methods=relicv2,byol,...] [gpu_gib=80] [key=value ...]`: the
per-GPU batch of each method that fits one GPU, estimated on any machine (a GPU is not needed).

Per method, one training step of the preset's network on the method's views (the preset's recipe and
mixes) runs under bf16 autocast, the mixed-precision casts of a GPU run (on the CPU when there is no
GPU), at two batch sizes. The bytes of the tensors autograd saves for the backward pass
(`torch.autograd.graph.saved_tensors_hooks`, each storage counted once) grow linearly with the batch;
their slope is the activation memory per image. Per image the loader adds every view batch of the
recipe (its fields and its mixes, float32: `pipelines.batch.view_bytes`) in DALI's prefetch queue of 2
batches, the batch its taker thread makes ahead and the batch in use (more where a run of the graph
makes several, and with the torch tail: `prefetched_batches`). Fixed: the parameters, their gradients and
the optimiser's momentum in float32, and the EMA target. The batch that fits is the largest even
batch with fixed + batch x per-image <= `headroom` x the GPU's memory (0.8 by default: cuDNN's
workspaces, the allocator's fragmentation and the transient buffers of the step).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from models.ema import make_target
from pipelines.batch import Batch, view_bytes
from pipelines.errors import bad_input
from pipelines.mixing import partner_index, with_mix_source
from pipelines.views import load_recipe
from train.config import Config, ConfigError
from train.objectives import OBJECTIVES
from train.objectives.base import StepValues
from train.resolve import load_config
from train.setup import build_online

def prefetched_batches(graph_batches: int = 1, torch_tail: bool = False) -> float:
    """Training batches of views the DALI loader holds on the GPU at once: runs of the graph of
    `graph_batches` each in DALI's prefetch queue (2), the run its taker thread makes ahead, the run in
    use (the step's batch among it) and, where a run makes several, the run's copy that its batches are
    cut out of: 4 with runs of one training batch. With the torch tail (`data.gpu_tail=torch`) DALI's
    queue holds uint8 crops (a quarter of the bytes) and the run made ahead reaches 3 runs of float
    views while the tail finishes it (its views, an intermediate and the normalised copy;
    `pipelines.dali_tail.finish`): 4.5 with runs of one."""
    k = graph_batches
    queue, ahead = (2 * k / 4, 3 * k) if torch_tail else (2 * k, k)
    return queue + ahead + k + (k if k > 1 else 0)


@dataclass(frozen=True)
class Estimate:
    method: str
    activations_mib_per_image: float     # saved for backward, bf16 autocast
    views_mib_per_image: float           # the loader's float32 views of one image, x `prefetched_batches`
    fixed_gib: float                     # parameters, gradients, momentum, EMA target
    fits: int                            # largest even per-GPU batch within the budget


def random_batch(cfg: Config, b: int) -> Batch:
    """A `Batch` of random views shaped as `cfg`'s recipe and mixes make them, for `b` samples."""
    recipe = with_mix_source(load_recipe(cfg.views.recipe, cfg.views.global_px, cfg.views.local_px), cfg.data.mix)
    fields = {}
    for name, groups in recipe.fields.items():
        n = sum(g.count for g in groups)
        fields[name] = torch.randn(n, b, 3, groups[0].size_px, groups[0].size_px) if n else None
    mixed = lam = partner = None
    if cfg.data.mix.kind != "none":
        v = 2 if cfg.data.mix.source == "image" else fields["global_views"].shape[0]
        mixed = torch.randn(v, b, 3, recipe.global_px, recipe.global_px)
        lam = torch.rand(v, b)
        partner = partner_index(b).expand(v, b).clone()
    return Batch(**fields, mixed=mixed, mix_lam=lam, mix_partner=partner, index=torch.arange(b))


def saved_bytes(cfg: Config, b: int) -> int:
    """Bytes autograd saves for the backward pass of one step of `cfg` on a batch of `b` (bf16 autocast)."""
    torch.manual_seed(0)
    online = build_online(cfg, torch.device("cpu"))
    objective = OBJECTIVES[cfg.method](cfg.objective)
    target = make_target(online) if objective.needs.target else None
    batch = random_batch(cfg, b)
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        try:
            storage = t.untyped_storage()
            seen[storage.data_ptr()] = storage.nbytes()
        except (RuntimeError, NotImplementedError):       # tensors without a plain storage
            pass
        return t

    s = StepValues(step=10**6, total_steps=10**6 + 1, epoch=10**3, lr=0.1, weight_decay=0.0, ema=0.99)
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = objective(online, target, batch, s)
    out.loss.backward()
    params = {p.untyped_storage().data_ptr() for p in online.parameters()}
    return sum(n for ptr, n in seen.items() if ptr not in params)


def estimate(cfg: Config, gpu_gib: float = 80.0, headroom: float = 0.8, batches: tuple[int, int] = (12, 16)) -> Estimate:
    """The per-GPU batch of `cfg.method` that fits a GPU of `gpu_gib` (module docstring)."""
    lo, hi = batches
    per_image = (saved_bytes(cfg, hi) - saved_bytes(cfg, lo)) / (hi - lo)
    recipe = with_mix_source(load_recipe(cfg.views.recipe, cfg.views.global_px, cfg.views.local_px), cfg.data.mix)
    views = view_bytes(recipe, cfg.data.mix) * prefetched_batches(cfg.data.graph_batches, cfg.data.gpu_tail == "torch")
    online = build_online(cfg, torch.device("cpu"))
    n_params = sum(p.numel() for p in online.parameters())
    fixed = 4 * n_params * (3 + int(OBJECTIVES[cfg.method].needs.target))   # weights, grads, momentum (+ target)
    budget = headroom * gpu_gib * 2**30 - fixed
    fits = int(budget // (per_image + views)) // 2 * 2
    return Estimate(cfg.method, per_image / 2**20, views / 2**20, fixed / 2**30, fits)


def main(argv: list[str]) -> int:
    words = dict(a.split("=", 1) for a in argv if "=" in a)
    methods = words.pop("methods", ",".join(sorted(OBJECTIVES))).split(",")
    gpu_gib = float(words.pop("gpu_gib", 80))
    data = words.pop("data", "imagenet")
    rest = [f"{k}={v}" for k, v in words.items()]
    rows = []
    try:
        for m in methods:
            cfg = load_config([f"method={m}", f"data={data}", "data.max_batch_per_gpu=0",
                               "optim.epochs=0", "optim.warmup_epochs=0", *rest])
            rows.append(estimate(cfg, gpu_gib))
            r = rows[-1]
            print(f"{m:>8}: {r.activations_mib_per_image:7.1f} MiB activations + {r.views_mib_per_image:5.1f} MiB views per "
                  f"image, {r.fixed_gib:.2f} GiB fixed -> fits {r.fits} per {gpu_gib:.0f} GiB GPU", flush=True)
    except ConfigError as e:
        return bad_input(e)
    print(f"smallest: {min(r.fits for r in rows)} ({min(rows, key=lambda r: r.fits).method})")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
