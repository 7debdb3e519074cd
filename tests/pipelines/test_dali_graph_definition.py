"""The DALI GPU graph, proven on a machine without a GPU: defined and serialised with `device_id=None`
for every preset × mix × masks, then every operator looked up in DALI's registry of operators for its
device, and the graph's placement checked: argument inputs from the CPU, nothing on the CPU but the
host's inputs and their routing (no operator there that touches pixels), one decode on the device,
every view leaving the graph on the device. The branch only the GPU graph takes is selected on the
CPU graph and compared with the CPU branch."""

from __future__ import annotations

import collections
from dataclasses import replace

import pytest
import torch

pytest.importorskip("nvidia.dali")

import nvidia.dali.backend as dali_registry  # noqa: E402

from pipelines.dali_backend import DaliLoader, define_pipeline, graph_operators  # noqa: E402
from pipelines.mixing import DACL_NOISES, MixSpec, with_mix_source  # noqa: E402
from pipelines.spec import DatasetInfo, LoaderSpec  # noqa: E402
from pipelines.views import PRESETS, load_recipe  # noqa: E402

MIXES = {"none": MixSpec(), "sdmp": MixSpec("sdmp"), "sdmp-image": MixSpec("sdmp", source="image"),
         "dacl+": MixSpec("dacl", alpha=0.5, source="image", dacl_noises=DACL_NOISES)}
REGISTRY = {"cpu": set(dali_registry.RegisteredCPUOps()), "gpu": set(dali_registry.RegisteredGPUOps()),
            "mixed": set(dali_registry.RegisteredMixedOps())}
# The only CPU operators a GPU graph may hold: the host's inputs, their routing into the branches, each
# grouped input taken out of its group, and the packed encoded files cut back to their bytes (one Slice
# for the images, one for the masks: `dali_backend.source_outputs`).
HOST_ROUTING = {"ExternalSource", "_conditional__Split", "_TensorSubscript", "Slice"}
# With `gpu_contrast="host"`, also each view's contrast offset made from its mean RGB copied back (3 values).
HOST_OFFSET = {"CoordTransform", "Reshape"}
# CPU operators per iteration of the GPU graph at most (GPU-readiness issue: the former in-graph
# draws were 972 for relicv2 and 453 for byol+sdmp).
CPU_BUDGET = {("relicv2", "none"): 150, ("byol", "sdmp"): 100}


def gpu_graph(preset: str, mix: MixSpec, masks: bool, contrast: str = "device"):
    recipe = with_mix_source(load_recipe(preset, 224, 96), mix)
    spec = LoaderSpec(root="", dataset="", split="train", recipe=recipe, batch_size=256, mix=mix, device="cuda",
                      gpu_contrast=contrast)
    pipe, out = define_pipeline(spec, masks, (0.5, 0.5, 0.5), (0.25, 0.25, 0.25), device_id=None)
    return recipe, graph_operators(pipe), out


@pytest.mark.parametrize("contrast", ["device", "host"])
@pytest.mark.parametrize("masks", [False, True], ids=["no-masks", "masks"])
@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("preset", PRESETS)
def test_gpu_graph_places_every_operator_where_dali_implements_it(preset: str, mix: str, masks: bool,
                                                                  contrast: str) -> None:
    recipe, (ops, outputs), out = gpu_graph(preset, MIXES[mix], masks, contrast)
    unregistered = [(o.schema, o.device) for o in ops if o.schema not in REGISTRY[o.device]]
    assert not unregistered, f"operators without an implementation on their device: {unregistered}"
    gpu_args = [o.schema for o in ops for dev, is_arg in o.inputs if is_arg and dev != "cpu"]
    assert not gpu_args, f"argument inputs must come from the CPU: {gpu_args}"
    on_cpu = collections.Counter(o.schema for o in ops if o.device == "cpu")
    offsets = {op: on_cpu.pop(op, 0) for op in HOST_OFFSET}
    assert set(on_cpu) <= HOST_ROUTING, f"CPU work in the GPU graph: {sorted(set(on_cpu) - HOST_ROUTING)}"
    # host offsets: one (3-value) offset and its reshape a view that has contrast, each from that view's mean
    means = sum(o.schema == "reductions__Mean" for o in ops)
    assert offsets == ({op: means for op in HOST_OFFSET} if contrast == "host" else dict.fromkeys(HOST_OFFSET, 0))
    # One image decode on the device, and one mask decode per batch where a view composites saliency,
    # outside every conditional (DALI 2.4 leaves a decoder's output in a branch no sample takes
    # without shape or layout); the source's pass-through outputs copied to the device.
    salient = masks and any(g.saliency_p > 0 for g in recipe.crop_groups)
    assert on_cpu["Slice"] == 1 + salient
    decodes = [o for o in ops if o.schema == "decoders__Image"]
    assert [o.device for o in decodes] == ["mixed"] * (1 + salient)
    assert {o.schema for o in ops if o.device == "mixed"} <= {"decoders__Image", "MakeContiguous"}
    # Every view and every mix leaves the graph on the device, and so do the batch's indices, labels,
    # partners and lams (passed through from the source).
    n_views = sum(g.count for groups in recipe.fields.values() for g in groups)
    n_mixed = 0 if mix == "none" else (2 if MIXES[mix].source == "image" else
                                       sum(g.count for g in recipe.fields["global_views"]))
    passed = 1 if mix == "none" else 2
    assert out.passed == ["ids", "lam"][:passed]
    assert outputs == ["gpu"] * (n_views + n_mixed + passed) and len(out.fields) == n_views + n_mixed
    # Conditionals only where the work differs per sample: the saliency composite and the batch's mixer
    # or noise; blur and solarize run on every sample with no-op parameters (a leaner GPU graph).
    views_salient = sum(g.count for g in recipe.crop_groups if g.saliency_p > 0) if salient else 0
    mixers = len(MIXES[mix].sdmp_mixers if MIXES[mix].kind == "sdmp" else MIXES[mix].dacl_noises)
    merges = sum(o.schema == "_conditional__Merge" for o in ops)
    assert merges == views_salient + (n_mixed * (mixers - 1) if mix != "none" else 0)
    assert not any(o.schema == "LookupTable" for o in ops)
    budget = CPU_BUDGET.get((preset, mix))
    if budget is not None:
        assert sum(on_cpu.values()) + sum(offsets.values()) <= budget, f"{sum(on_cpu.values())} CPU operators"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    from preprocess.prepare import prepare_dataset

    root = tmp_path_factory.mktemp("graph")
    prepare_dataset("synthetic", root, workers=1, train_size=16, val_size=8, image_px=32, seed=0,
                    gt_masks_as_mask=True)
    return root


def test_the_loader_reports_its_graphs_operators_for_the_benches(root) -> None:
    from bench.data import operator_lines

    info = DatasetInfo.read(root, "synthetic", "train")
    spec = LoaderSpec(root=str(root), dataset="synthetic", split="train", recipe=load_recipe("relicv2", 32, 16),
                      batch_size=8)
    counts = DaliLoader(spec, info).operator_counts()
    _, (ops, _), _ = gpu_graph("relicv2", MixSpec(), info.reads_masks)
    assert counts["gpu_graph"] == dict(collections.Counter(o.device for o in ops))
    assert set(counts["cpu_graph"]) == {"cpu"} and counts["cpu_graph"]["cpu"] > counts["gpu_graph"]["cpu"]
    (line,) = operator_lines([{"backend": "dali", "recipe": "relicv2", "operators": counts}])[1:]
    assert line.startswith(f"dali operators per iteration, relicv2: GPU graph {counts['gpu_graph']['cpu']} cpu / ")


@pytest.mark.parametrize("gpu_blur", ["gaussian", "filter", "conditional"])
def test_the_gpu_branch_equals_the_cpu_branch_on_the_cpu_graph(root, gpu_blur: str) -> None:
    """The colour pass of the GPU graph (the contrast offset added on the device, then rounded) and its
    blur (DALI's on every sample with a window of 1 where none was drawn, one pass of per-sample
    kernels made on the host, 1 x 1 where none was drawn, or DALI's in a conditional) give the CPU
    graph's views (the offset as the pass's argument, the blur in a conditional) to within one level."""
    info = DatasetInfo.read(root, "synthetic", "train")
    recipe = load_recipe("byol", 32, 16)
    recipe = replace(recipe, groups=tuple(replace(g, jitter_p=1.0, blur_p=0.5) for g in recipe.groups))
    spec = LoaderSpec(root=str(root), dataset="synthetic", split="train", recipe=recipe, batch_size=8, seed=3,
                      gpu_blur=gpu_blur)
    cpu = list(DaliLoader(spec, info))
    gpu_branch = list(DaliLoader(spec, info, gpu_branches=True))
    std = torch.tensor(info.std).view(3, 1, 1)
    for a, b in zip(cpu, gpu_branch):
        assert torch.equal(a.index, b.index)
        assert float(((a.global_views - b.global_views) * std * 255).abs().max()) <= 1.0 + 1e-3


HOST_CONTRAST_CASES = {"relicv2+masks": ("relicv2", MixSpec()), "rsa": ("rsa", MixSpec()),
                       "multicrop8+sdmp": ("multicrop8", MixSpec("sdmp")), "byol+dacl+": ("byol", MIXES["dacl+"]),
                       "byol+dacl-linear-binary": ("byol", replace(MIXES["dacl+"], dacl_noises=("linear", "binary")))}
# On a GPU a level may round the other way (the offset added inside the pass or after it), which the
# geometric noise x^λ·x'^(1-λ) turns into many near 0 (its slope is unbounded there): DACL+ is compared
# on the CPU, its other noises on both.
HOST_CONTRAST_RUNS = ([(case, "cpu") for case in sorted(HOST_CONTRAST_CASES)]
                      + [pytest.param(case, "cuda", marks=pytest.mark.gpu) for case in sorted(HOST_CONTRAST_CASES)
                         if case != "byol+dacl+"])


@pytest.mark.parametrize(("case", "device"), HOST_CONTRAST_RUNS)
def test_the_contrast_offset_made_on_the_host_gives_the_views_of_the_device_s(root, case: str, device: str) -> None:
    """`gpu_contrast="host"` (each view's mean copied back, the offset the colour pass's argument, one
    uint8 pass) hands out the batches of the default GPU graph (the offset added on the device after a
    float pass, then a cast): on the CPU graph with the GPU's branches bit for bit; on a GPU within
    one level. Saliency composited before the pass (relicv2), staged views (RSA), the mixes of views
    and of the whole image (SDMP, DACL)."""
    info = DatasetInfo.read(root, "synthetic", "train")
    preset, mix = HOST_CONTRAST_CASES[case]
    assert info.reads_masks
    spec = LoaderSpec(root=str(root), dataset="synthetic", split="train", recipe=with_mix_source(
        load_recipe(preset, 32, 16), mix), batch_size=8, seed=3, mix=mix, device=device)
    on_cpu = device == "cpu"
    on_device = list(DaliLoader(spec, info, gpu_branches=on_cpu))
    on_host = list(DaliLoader(replace(spec, gpu_contrast="host"), info, gpu_branches=on_cpu))
    assert len(on_device) == len(on_host) == 2
    level = 1.0 / 255 / min(info.std) + 1e-4
    for a, b in zip(on_device, on_host):
        assert torch.equal(a.index.cpu(), b.index.cpu())
        for name in ("global_views", "local_views", "weak_views", "mixed"):
            x, y = getattr(a, name), getattr(b, name)
            assert (x is None) == (y is None), name
            if x is not None:
                diff = float((x - y).abs().max())
                assert x.shape == y.shape and (diff == 0.0 if on_cpu else diff <= level), (name, diff)


def test_the_contrast_offset_made_on_the_host_leaves_one_colour_operator_a_view_on_the_device() -> None:
    """relicv2's GPU graph with `gpu_contrast="host"`: per view one colour pass on the device (uint8 out,
    the offset its argument from the CPU) where the default graph has a float pass, an add and a cast:
    54 GPU operators become 36."""
    def gpu_ops(contrast: str) -> collections.Counter:
        _, (ops, _), _ = gpu_graph("relicv2", MixSpec(), False, contrast)
        return collections.Counter(o.schema for o in ops if o.device == "gpu")

    device, host = gpu_ops("device"), gpu_ops("host")
    assert device["CoordTransform"] == 12 and device["Cast"] == 6 and device["_ArithmeticGenericOp"] == 12
    assert host["CoordTransform"] == 6 and host["Cast"] == 0 and host["_ArithmeticGenericOp"] == 6   # solarize's 2 x 3
    assert sum(device.values()) - sum(host.values()) == 3 * 6


def test_the_conditional_blur_blurs_only_the_views_that_may_skip_it_in_a_branch() -> None:
    """`gpu_blur="conditional"`: relicv2's GPU graph blurs its 3 views of blur p 0.1 in a conditional (a
    merge each, the samples that drew no blur skip the operator) and its 3 of p 1 on every sample, each
    operator where DALI implements it, its arguments from the CPU."""
    spec = LoaderSpec(root="", dataset="", split="train", recipe=load_recipe("relicv2", 224, 96), batch_size=256,
                      device="cuda", gpu_blur="conditional")
    ops, _ = graph_operators(define_pipeline(spec, False, (0.5,) * 3, (0.25,) * 3, device_id=None)[0])
    assert all(o.schema in REGISTRY[o.device] for o in ops)
    assert not [o.schema for o in ops for dev, is_arg in o.inputs if is_arg and dev != "cpu"]
    some = sum(0 < g.blur_p < 1 for g in spec.recipe.groups)
    assert some == 3 and sum(o.schema == "_conditional__Merge" for o in ops) == some
    assert sum(o.schema == "GaussianBlur" and o.device == "gpu" for o in ops) == 6


def test_the_conditional_blur_gives_the_views_of_the_blur_on_every_sample(root) -> None:
    """On the CPU graph with the GPU's branches, `gpu_blur="conditional"` (the samples that drew no blur
    skip it) and the default (a window of 1 for them) give the same views to the bit: DALI's window for
    a sigma is the 2·ceil(3σ)+1 the default passes."""
    info = DatasetInfo.read(root, "synthetic", "train")
    spec = LoaderSpec(root=str(root), dataset="synthetic", split="train", recipe=load_recipe("relicv2", 32, 16),
                      batch_size=8, seed=5)
    every = list(DaliLoader(spec, info, gpu_branches=True))
    conditional = list(DaliLoader(replace(spec, gpu_blur="conditional"), info, gpu_branches=True))
    assert len(every) == len(conditional) == 2
    for a, b in zip(every, conditional):
        assert torch.equal(a.global_views, b.global_views) and torch.equal(a.local_views, b.local_views)


def test_the_filter_blur_takes_host_kernels_and_replaces_every_gaussian_blur() -> None:
    """`gpu_blur="filter"`: one Filter per blurred view of the GPU graph, its kernels a regular input from
    the host (the one CPU input of a GPU operator), no GaussianBlur, and no more GPU operators."""
    spec = LoaderSpec(root="", dataset="", split="train", recipe=load_recipe("relicv2", 224, 96), batch_size=256,
                      device="cuda", gpu_blur="filter")
    ops, _ = graph_operators(define_pipeline(spec, False, (0.5,) * 3, (0.25,) * 3, device_id=None)[0])
    base, _ = graph_operators(define_pipeline(replace(spec, gpu_blur="gaussian"), False, (0.5,) * 3, (0.25,) * 3,
                                              device_id=None)[0])
    filters = [o for o in ops if o.schema == "Filter"]
    assert len(filters) == sum(o.schema == "GaussianBlur" for o in base) == 6
    assert not any(o.schema == "GaussianBlur" for o in ops) and all(f.device == "gpu" for f in filters)
    cpu_into_gpu = {o.schema for o in ops if o.device == "gpu" for dev, arg in o.inputs if dev == "cpu" and not arg}
    assert cpu_into_gpu == {"Filter"} and all(o.schema in REGISTRY[o.device] for o in ops)
    assert sum(o.device == "gpu" for o in ops) == sum(o.device == "gpu" for o in base)


def test_uint8_outputs_drop_the_graph_s_normalisation() -> None:
    """`graph_dtype="uint8"` on the GPU graph of relicv2 (channels-last, as a GPU network takes it): no
    CropMirrorNormalize, none added in its place, one GPU operator fewer per view; CHW outputs take a
    Transpose each instead."""
    spec = LoaderSpec(root="", dataset="", split="train", recipe=load_recipe("relicv2", 224, 96), batch_size=256,
                      device="cuda", channels_last=True)

    def ops(**kw):
        return graph_operators(define_pipeline(replace(spec, **kw), False, (0.5,) * 3, (0.25,) * 3, device_id=None)[0])[0]

    base, raw, chw = ops(), ops(graph_dtype="uint8"), ops(graph_dtype="uint8", channels_last=False)
    assert sum(o.schema == "CropMirrorNormalize" for o in base) == 6
    assert not any(o.schema == "CropMirrorNormalize" for o in raw + chw)
    assert sum(o.device == "gpu" for o in raw) == sum(o.device == "gpu" for o in base) - 6
    assert sum(o.schema == "Transpose" for o in chw) == 6 and len(chw) == len(base)


def test_each_view_of_the_gpu_graph_costs_its_pixel_operators_and_no_more() -> None:
    """The GPU operators of relicv2's graph, counted from its recipe (each DALI arithmetic node is one
    operator, and each operator's host set-up is what the GPU graph's batch waits on): per view the
    resize, the colour pass (mean, the offset's and the view's transforms, the offset's add, the cast
    back to uint8), the blur, the normalisation, and where the view solarizes two uint8 operators
    (min(x, x ^ mask)); one decode for the batch."""
    recipe, (ops, _), _ = gpu_graph("relicv2", MixSpec(), False)
    on_gpu = collections.Counter(o.schema for o in ops if o.device != "cpu")
    views = sum(g.count for g in recipe.crop_groups)
    solarizing = sum(g.count for g in recipe.crop_groups if g.solarize_p > 0)
    assert solarizing == 3 and views == 6
    assert on_gpu == {"decoders__Image": 1, "Resize": views, "reductions__Mean": views, "CoordTransform": 2 * views,
                      "Cast": views, "GaussianBlur": views, "CropMirrorNormalize": views,
                      "_ArithmeticGenericOp": views + 2 * solarizing}


@pytest.mark.parametrize("mix", sorted(MIXES))
@pytest.mark.parametrize("masks", [False, True], ids=["no-masks", "masks"])
@pytest.mark.parametrize("preset", PRESETS)
def test_with_the_torch_tail_the_gpu_graph_stops_at_the_crops(preset: str, masks: bool, mix: str) -> None:
    """`gpu_tail="torch"`: the GPU graph holds the decode, one resize a crop view and the saliency
    composite, nothing of the colour tail, the blur, solarize, the mixes or the normalisation
    (relicv2: 6 GPU operators where the graph's own tail has 54); each crop view leaves on the device
    with the batch's ids and lams, the tail's parameters and mix draws on the host (the loader picks
    the views that blur there), and nothing is drawn in the graph."""
    recipe = with_mix_source(load_recipe(preset, 224, 96), MIXES[mix])
    spec = LoaderSpec(root="", dataset="", split="train", recipe=recipe, batch_size=256, mix=MIXES[mix],
                      device="cuda", gpu_tail="torch")
    pipe, out = define_pipeline(spec, masks, (0.5,) * 3, (0.25,) * 3, device_id=None)
    ops, outputs = graph_operators(pipe)
    assert all(o.schema in REGISTRY[o.device] for o in ops)
    assert not [o.schema for o in ops for dev, is_arg in o.inputs if is_arg and dev != "cpu"]
    assert set(o.schema for o in ops if o.device == "cpu") <= HOST_ROUTING
    crops = [f"{g.name}/{v}" for g in recipe.crop_groups for v in range(g.count)]
    salient = [g.count for g in recipe.crop_groups if g.saliency_p > 0] if masks else []
    on_gpu = collections.Counter(o.schema for o in ops if o.device == "gpu")
    assert on_gpu["Resize"] == len(crops) + sum(salient)          # each view's crop, and its mask's where salient
    assert set(on_gpu) <= {"Resize", "_ArithmeticGenericOp", "_conditional__Split", "_conditional__Merge"}
    assert on_gpu["_conditional__Merge"] == sum(salient)
    if preset == "relicv2" and not masks and mix == "none":
        assert sum(on_gpu.values()) == 6
    mixed = mix != "none"
    assert out.tail and out.fields == crops
    assert out.passed == ["ids", "lam", "tail", "tail_mix"] if mixed else out.passed == ["ids", "tail"]
    assert outputs == ["gpu"] * (len(crops) + 1 + mixed) + ["cpu"] * (1 + mixed)
