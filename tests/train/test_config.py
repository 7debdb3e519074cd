"""Config: merge order, unknown keys with suggestions, bad types, objective section, needs check."""

from __future__ import annotations

import dataclasses
import subprocess
import sys
from pathlib import Path

import pytest

from pipelines.views import Recipe, ViewGroup
from train.config import Config, ConfigError, to_dict
from train.objectives import OBJECTIVES
from train.objectives.base import ViewNeeds, check_needs
from train.resolve import config_from_dict, load_config

ROOT = Path(__file__).resolve().parents[2]


def write_presets(tmp_path, base: str, data: str, method: str):
    (tmp_path / "data").mkdir()
    (tmp_path / "method").mkdir()
    (tmp_path / "base.yaml").write_text(base)
    (tmp_path / "data" / "tiny.yaml").write_text(data)
    (tmp_path / "method" / "byol.yaml").write_text(method)
    return tmp_path


def test_merge_order_defaults_base_data_method_cli(tmp_path) -> None:
    d = write_presets(tmp_path, "optim:\n  lr: 1.0\n  steps: 7\n  warmup_steps: 3\n  clip: 2.0\n",
                      "optim:\n  lr: 2.0\n  steps: 8\n  warmup_steps: 4\n",
                      "optim:\n  lr: 3.0\n  steps: 9\n")
    cfg = load_config(["method=byol", "data=tiny", "optim.lr=4.0"], config_dir=d)
    assert cfg.optim.lr == 4.0             # CLI beats method
    assert cfg.optim.steps == 9            # method beats data
    assert cfg.optim.warmup_steps == 4     # data beats base
    assert cfg.optim.clip == 2.0           # base beats defaults
    assert cfg.optim.momentum == Config().optim.momentum   # dataclass default
    assert cfg.data.name == "tiny" and cfg.method == "byol"
    assert isinstance(cfg.objective, OBJECTIVES["byol"].Config)


def test_the_layers_merge_in_the_order_config_yaml_names_them(tmp_path) -> None:
    """Each value comes from the last layer that sets it, and `Config.layers` names the layers that set
    something, in that order, with the world the run was resolved for."""
    import yaml

    d = write_presets(tmp_path, "optim:\n  lr: 1.0\n  clip: 2.0\n  momentum: 0.5\n",
                      "optim:\n  lr: 2.0\n  epochs: 3\n  weight_decay: 0.1\nper_method:\n  byol:\n    optim:\n"
                      "      lr: 2.5\n      weight_decay: 0.2\n",
                      "optim:\n  lr: 3.0\n  clip: 3.0\n")
    file = tmp_path / "mine.yaml"
    file.write_text(yaml.safe_dump({"optim": {"lr": 5.0, "momentum": 0.7}}))
    cfg = load_config(["method=byol", "data=tiny", f"config={file}", "optim.momentum=0.8"], config_dir=d)
    assert cfg.layers == ("base", "preset tiny", "method byol", "method byol on tiny", f"file {file}", "picks",
                          "words", "world 1")
    assert (cfg.optim.clip, cfg.optim.weight_decay, cfg.optim.lr, cfg.optim.momentum) == (3.0, 0.2, 5.0, 0.8)
    assert cfg.optim.epochs == 3.0                      # no word names the length: the preset's epochs stay
    words = load_config(["method=byol", "data=tiny", "optim.steps=11"], config_dir=d, world_size=2)
    assert words.layers == ("base", "preset tiny", "method byol", "method byol on tiny", "picks", "words", "world 2")
    assert (words.optim.steps, words.optim.epochs) == (11, 0.0)    # the user's steps over the preset's epochs
    plain = load_config(["method=rsa", "data=synthetic", f"data.root={tmp_path / 'none'}"])  # no dataset folder
    assert plain.layers == ("base", "preset synthetic", "method rsa", "picks", "words", "world 1")
    with pytest.raises(ConfigError, match="'layers' is where a config's values came from.*remove it"):
        load_config(["method=rsa", "data=synthetic", "layers=[base]"])


def test_a_global_batch_splits_into_even_per_process_batches_or_names_the_multiple() -> None:
    from train.config import per_process_batch

    assert [per_process_batch(512, n) for n in (1, 2, 8, 64)] == [512, 256, 64, 8]
    with pytest.raises(ConfigError, match=r"data\.batch_size=100 must split .* over 8 process.*a multiple of 16"):
        per_process_batch(100, 8)                       # 12.5 a process
    with pytest.raises(ConfigError, match=r"^batch_size=6 must split .*a multiple of 4"):
        per_process_batch(6, 2, "batch_size")           # 3 a process: no pairs


def test_unknown_key_lists_closest_keys() -> None:
    with pytest.raises(ConfigError, match=r"unknown config key 'optim\.lrr'.*optim\.lr"):
        load_config(["method=rsa", "data=synthetic", "optim.lrr=0.1"])
    with pytest.raises(ConfigError, match=r"did you mean.*data\.batch_size"):
        load_config(["method=rsa", "data=synthetic", "data.batchsize=8"])


def test_exponent_without_dot_reads_as_float() -> None:
    # YAML 1.1 reads `1e-4` as a string; a user typing it on the command line means a float.
    cfg = load_config(["method=rsa", "data=synthetic", "optim.weight_decay=1e-4", "optim.lr=5E-2"])
    assert cfg.optim.weight_decay == 1e-4 and cfg.optim.lr == 0.05


def test_checkpoint_intervals_that_keep_nothing_are_one_line_errors_naming_the_fix() -> None:
    assert load_config(["method=rsa", "data=synthetic"]).run.ckpt_every_min == 30.0
    assert load_config(["method=rsa", "data=synthetic", "run.ckpt_every_min=0"]).run.ckpt_every_min == 0.0
    with pytest.raises(ConfigError, match=r"run.ckpt_every_min=-5.0 is negative; use minutes > 0, or 0"):
        load_config(["method=rsa", "data=synthetic", "run.ckpt_every_min=-5"])
    with pytest.raises(ConfigError, match="run.keep_last=0 keeps no checkpoint; use run.keep_last=1"):
        load_config(["method=rsa", "data=synthetic", "run.keep_last=0"])


def test_bad_type_is_an_error() -> None:
    with pytest.raises(ConfigError, match=r"optim\.steps.*int"):
        load_config(["method=rsa", "data=synthetic", "optim.steps=1.5"])
    with pytest.raises(ConfigError, match=r"optim\.lr.*float"):
        load_config(["method=rsa", "data=synthetic", "optim.lr=fast"])
    with pytest.raises(ConfigError, match="not key=value"):
        load_config(["method=rsa", "optim.lr"])
    for batch, fix in (("lots", r"give the global batch .*or the batch of each process \(e.g. data.batch_size=256/gpu"),
                       ("0", "give the global batch"), ("7/gpu", r"must be even.*data.batch_size=8/gpu")):
        with pytest.raises(ConfigError, match=fix):
            load_config(["method=rsa", "data=synthetic", f"data.batch_size={batch}"])


def test_objective_section_is_validated_by_the_objective_config() -> None:
    field = dataclasses.fields(OBJECTIVES["simclr"].Config)[0]
    with pytest.raises(ConfigError, match="objective"):
        load_config(["method=simclr", "data=synthetic", f"objective.{field.name}x=1"])
    with pytest.raises(ConfigError, match="did you mean rsa"):
        load_config(["method=rsaa", "data=synthetic"])


@pytest.mark.parametrize("method", sorted(OBJECTIVES))
def test_every_method_preset_resolves_and_round_trips(method: str) -> None:
    cfg = load_config([f"method={method}", "data=synthetic"])
    assert config_from_dict(to_dict(cfg)) == cfg
    if not OBJECTIVES[method].needs.target:
        assert cfg.model.pred_hidden == 0


@pytest.mark.parametrize("key, value, choices", [
    ("data.backend", "torhc", "auto, torch, torchvision, ffcv, dali"),
    ("optim.name", "adam", "lars, sgd, momentum, adamw"),
    ("data.mix.kind", "cutmix", "none, sdmp, dacl"),
    ("data.mix.source", "views", "global, image"),
    ("run.device", "cuda:1", "auto, cpu, cuda"),
])
def test_enumerated_value_outside_the_choices_is_an_error_naming_them(key, value, choices) -> None:
    with pytest.raises(ConfigError, match=rf"{key}.*{value}.*choose one of {choices}$"):
        load_config(["method=rsa", "data=synthetic", f"{key}={value}"])
    tree = to_dict(load_config(["method=rsa", "data=synthetic"]))
    section, _, name = key.rpartition(".")
    node = tree
    for part in section.split("."):
        node = node[part]
    node[name] = value
    with pytest.raises(ConfigError, match=rf"{key}.*choose one of {choices}$"):
        config_from_dict(tree)


def test_enumerated_value_in_a_preset_is_checked(tmp_path) -> None:
    d = write_presets(tmp_path, "data:\n  backend: dalli\n", "", "")
    with pytest.raises(ConfigError, match=r"data\.backend.*'dalli'.*choose one of auto, torch"):
        load_config(["method=byol", "data=tiny"], config_dir=d)
    assert load_config(["method=uota", "data=synthetic", "objective.base=mocov2star"]).objective.base == "mocov2star"
    with pytest.raises(ConfigError, match=r"objective\.base.*choose one of byol, mocov2star"):
        load_config(["method=uota", "data=synthetic", "objective.base=swav"])
    with pytest.raises(ConfigError, match=r"objective\.tau must be > 0.*objective\.tau=0\.5"):
        load_config(["method=simclr", "data=synthetic", "objective.tau=0"])


@pytest.mark.slow
def test_cli_rejects_a_bad_choice_before_writing_the_run_folder(tmp_path) -> None:
    out = tmp_path / "runs"
    done = subprocess.run([sys.executable, "-m", "train", "method=rsa", "data=synthetic", "data.backend=torhc",
                           f"run.out_dir={out}"], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert "data.backend" in done.stderr and "choose one of auto, torch, torchvision, ffcv, dali" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and not out.exists()


def test_needs_check_names_the_missing_views() -> None:
    recipe = Recipe("two", (ViewGroup("g", count=2, size_px=64),))
    check_needs("byol", ViewNeeds(global_views=2), recipe, "none")
    with pytest.raises(ConfigError, match="staged weak views"):
        check_needs("rsa", ViewNeeds(weak=True), recipe, "none")
    with pytest.raises(ConfigError, match="2 local views"):
        check_needs("relicv2", ViewNeeds(local=2), recipe, "none")
    with pytest.raises(ConfigError, match="data.mix.kind=sdmp"):
        check_needs("sdmp", ViewNeeds(mix="sdmp"), recipe, "none")
    staged = Recipe("rsa", (ViewGroup("weak", count=2, size_px=64),
                            ViewGroup("strong", count=2, size_px=64, parent="weak")))
    check_needs("rsa", ViewNeeds(weak=True), staged, "none")


def test_needs_check_counts_the_roles_the_recipe_resolved() -> None:
    # A crop at the global size that the recipe calls local counts as local, not as global.
    recipe = Recipe("odd", (ViewGroup("g", count=2, size_px=64), ViewGroup("l", count=2, size_px=64, role="local")))
    check_needs("relicv2", ViewNeeds(global_views=2, local=2), recipe, "none")
    with pytest.raises(ConfigError, match=r"4 global views \(recipe has 2\)"):
        check_needs("relicv2", ViewNeeds(global_views=4, local=2), recipe, "none")
    # Staged views feed global_views, their weak parents weak_views; one more crop at the global size.
    staged = Recipe("rsa+1", (ViewGroup("weak", count=2, size_px=64), ViewGroup("strong", count=2, parent="weak"),
                              ViewGroup("extra", count=1, size_px=64)))
    check_needs("rsa", ViewNeeds(global_views=3, weak=True), staged, "none")
    with pytest.raises(ConfigError, match=r"4 global views \(recipe has 3\)"):
        check_needs("rsa", ViewNeeds(global_views=4, weak=True), staged, "none")


def test_dacl_preset_is_plain_dacl_and_dacl_plus_reaches_the_loader() -> None:
    """Algorithm 1 (linear mixup) by default; the noise list and rho of `data.mix` reach the MixSpec."""
    plain = load_config(["method=dacl"]).data.mix
    assert plain.kind == "dacl" and plain.dacl_noises == ("linear",) and plain.binary_swap == 0.3
    plus = load_config(["method=dacl", "data.mix.dacl_noises=[linear,geometric,binary]",
                        "data.mix.binary_swap=0.1"]).data.mix
    assert plus.dacl_noises == ("linear", "geometric", "binary") and plus.binary_swap == 0.1


@pytest.mark.parametrize("data", ["synthetic", "cifar10", "cifar100", "imagenet"])
def test_relicv2_online_and_target_have_the_same_form_on_every_data_preset(data: str) -> None:
    """Listing 1 of RELICv2: no predictor on the online side, whatever the data preset's width."""
    assert load_config(["method=relicv2", f"data={data}"]).model.pred_hidden == 0


@pytest.mark.parametrize("method, layers, last_bn, pred_bn, out, tau, recipe", [
    ("mocov3", 2, True, False, None, 1.0, "mocov3"),  # moco-v3's MoCo_ResNet: the projector with a last BN, the
                                                      # predictor without (`_build_mlp(2, dim, mlp_dim, dim, False)`)
    ("sdmp", 2, True, False, None, 1.0, "byol"),      # SDMP's MoCo_ResNet: its predictor has no last BN
    ("dacl", 3, False, False, 128, None, "plain"),    # DACL Sec. 5.2: "a 3-layer MLP projection-head ... 128-dimensional"
])
def test_method_presets_use_the_heads_and_temperatures_their_papers_state(method, layers, last_bn, pred_bn, out, tau,
                                                                          recipe) -> None:
    for data in ("synthetic", "cifar10", "imagenet"):
        cfg = load_config([f"method={method}", f"data={data}"])
        assert (cfg.model.proj_layers, cfg.model.proj_last_bn, cfg.model.pred_last_bn) == (layers, last_bn, pred_bn), data
        assert out is None or cfg.model.proj_out == out
        assert tau is None or cfg.objective.tau == tau
        assert cfg.views.recipe == recipe


# Each method's ImageNet setting from its own paper (or the code it names), read from a written ImageNet-1k
# manifest at 8 GPUs x 256: (epochs, lr at batch 256, weight decay, warm-up epochs, EMA momentum at step 0).
IMAGENET = {
    "byol": (1000, 0.2, 1.5e-6, 10, 0.996),      # BYOL Sec. 3.3 / App. C: tau_base 0.996
    "relicv2": (1000, 0.2, 1.5e-6, 10, None),    # RELICv2 Sec. 3 (1000 epochs, 10 warm-up); its one EMA below
    "uota": (1000, 0.2, 1.5e-6, 10, 0.996),      # UOTA Sec. S.5: the BYOL base's own pipeline
    "mocov3": (1000, 0.3, 1.5e-6, 10, 0.996),    # MoCo v3 CONFIG.md, ResNet-50 1000 epochs
    "sdmp": (300, 0.3, 1e-6, 10, 0.99),          # SDMP Table 1 (300 epochs) on MoCo v3's 300-epoch config
    "rsa": (200, 0.6, 1e-6, 10, 0.996),          # RSA Sec. 4.1: LARS, lr 0.6 (200 epochs), wd 1e-6; BYOL's rest
    "dacl": (100, 0.3, 1e-6, 10, None),          # DACL Sec. 5.2: 100 epochs, lr 0.3, wd 1e-6, 10 warm-up epochs
}


@pytest.mark.parametrize("method", sorted(IMAGENET))
def test_each_method_trains_imagenet_as_its_paper_states(tmp_path, method: str) -> None:
    from train.schedules import scaled_lr

    write_manifest(tmp_path, "imagenet", train=1_281_167, px=500, classes=1000)
    cfg = load_config([f"method={method}", "data=imagenet", f"data.root={tmp_path}"], world_size=8)
    epochs, lr, wd, warmup, ema = IMAGENET[method]
    per_epoch = 1_281_167 // 2048
    assert cfg.data.batch_size == 2048 and cfg.optim.name == "lars"
    assert (cfg.optim.steps, cfg.optim.warmup_steps) == (epochs * per_epoch, warmup * per_epoch)
    assert scaled_lr(cfg.optim.lr, 2048) == pytest.approx(lr * 8)
    assert cfg.optim.weight_decay == cfg.optim.final_weight_decay == wd
    assert ema is None or (cfg.optim.ema_start, cfg.optim.ema_end) == (ema, 1.0)
    if method == "relicv2":     # App. C.1: EMA 0.996, and App. D's one gamma at every step (BYOL's rises to 1)
        from train import schedules

        objective = OBJECTIVES[method](cfg.objective)
        first, last = (schedules.at(cfg.optim, k, per_epoch, 2048) for k in (0, cfg.optim.steps - 1))
        assert objective.target_momentum(first) == objective.target_momentum(last) == 0.996 < last.ema
    if method == "rsa":
        assert cfg.objective.beta_base == 0.4
        short = load_config(["method=rsa", "data=imagenet", f"data.root={tmp_path}", "optim.epochs=100", "optim.lr=0.9"],
                            world_size=8)
        assert short.optim.steps == 100 * per_epoch and short.optim.lr == 0.9


@pytest.mark.parametrize("data", ["cifar10", "cifar100"])
def test_cifar_sdmp_preset_is_table_5s_resnet_50_for_200_epochs(tmp_path, data: str) -> None:
    """SDMP Sec. 4.2 / Table 5: ResNet-50 (the small-image stem at 32 px) for 200 epochs, 2000 for the long
    rows; the optimiser of its code's defaults (LARS lr 0.6, wd 1e-6, 10 warm-up epochs, a constant key momentum
    of 0.99: `--moco-m-cos` is off by default)."""
    write_manifest(tmp_path, data, train=50_000, px=32, classes=10)
    cfg = load_config(["method=sdmp", f"data={data}", f"data.root={tmp_path}"])
    per_epoch = 50_000 // 512
    assert cfg.model.backbone == "resnet50" and (cfg.model.proj_hidden, cfg.model.pred_hidden) == (4096, 4096)
    assert (cfg.optim.steps, cfg.optim.warmup_steps) == (200 * per_epoch, 10 * per_epoch)
    assert (cfg.optim.name, cfg.optim.lr, cfg.optim.weight_decay, cfg.optim.ema_start, cfg.optim.ema_end) == \
        ("lars", 0.6, 1e-6, 0.99, 0.99)
    long = load_config(["method=sdmp", f"data={data}", f"data.root={tmp_path}", "optim.epochs=2000",
                        "model.backbone=resnet101"])
    assert long.optim.steps == 2000 * per_epoch and long.model.backbone == "resnet101"
    assert load_config(["method=mocov3", f"data={data}", f"data.root={tmp_path}"]).model.backbone == "resnet18"


def test_relicv2_loss_weights_are_the_only_ones_the_paper_states() -> None:
    """App. C.1: contrast scale 0.3 (alpha) and invariance scale 2.0 (beta), tau 0.2."""
    obj = load_config(["method=relicv2", "data=synthetic"]).objective
    assert (obj.alpha, obj.beta, obj.tau) == (0.3, 2.0, 0.2)


@pytest.mark.parametrize("data", ["cifar10", "cifar100"])
def test_cifar_rsa_preset_is_the_papers_small_dataset_setting(data: str) -> None:
    """RSA Sec. 4.1: beta_base 0.3 on CIFAR-10/100 with SGD lr 0.1, wd 5e-4, batch 256, 1024/128 heads;
    other methods on CIFAR keep the data preset's values, and a CLI override still wins."""
    cfg = load_config(["method=rsa", f"data={data}"])
    assert cfg.objective.beta_base == 0.3 and cfg.data.batch_size == 256
    assert (cfg.optim.name, cfg.optim.lr, cfg.optim.weight_decay) == ("momentum", 0.1, 5e-4)
    assert (cfg.model.proj_hidden, cfg.model.proj_out, cfg.model.pred_hidden) == (1024, 128, 1024)
    assert load_config(["method=rsa", "data=synthetic"]).objective.beta_base == 0.4
    assert load_config(["method=byol", f"data={data}"]).optim.name == "lars"
    assert load_config(["method=rsa", f"data={data}", "objective.beta_base=0.5"]).objective.beta_base == 0.5


@pytest.mark.parametrize("data", ["cifar10", "cifar100"])
def test_cifar_rsa_schedule_is_the_official_codes(tmp_path, data: str) -> None:
    """RSA on CIFAR: 200 epochs of the written split (800 by optim.epochs), no warm-up, plain momentum
    SGD (timm's "sgd" is Nesterov) with weight decay on every parameter, biases and norms included."""
    import torch
    from torch import nn

    from train.optim import build_optimizer

    write_manifest(tmp_path, data, train=50_000, px=32, classes=10)
    cfg = load_config(["method=rsa", f"data={data}", f"data.root={tmp_path}"])
    assert (cfg.optim.steps, cfg.optim.warmup_steps) == (200 * (50_000 // 256), 0)
    assert load_config(["method=rsa", f"data={data}", f"data.root={tmp_path}", "optim.epochs=800"]).optim.steps == 800 * 195
    net = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    opt = build_optimizer(cfg, [net])
    assert isinstance(opt, torch.optim.SGD) and all(not g["nesterov"] and g["momentum"] == 0.9 for g in opt.param_groups)
    assert all(g["weight_decay"] == 5e-4 for g in opt.param_groups)
    assert sum(len(g["params"]) for g in opt.param_groups) == 4
    byol = build_optimizer(load_config(["method=byol", "data=synthetic"]), [net])        # weights only, as before
    assert sorted(len(g["params"]) for g in byol.param_groups if g["weight_decay"] > 0) == [1]


def write_manifest(root: Path, name: str, *, train: int, px: int, classes: int = 7) -> Path:
    """A dataset folder holding only a manifest (no files listed): what the config reads."""
    from pipelines.schema import SCHEMA_VERSION, Manifest

    m = Manifest(schema_version=SCHEMA_VERSION, dataset=name, source="imagefolder", counts={"train": train, "val": 10},
                 class_names=tuple(f"c{i}" for i in range(classes)), image_mode="jpg", image_px=px,
                 has_masks=False, mean=(0.5,) * 3, std=(0.2,) * 3, files={})
    (root / name).mkdir(parents=True)
    (root / name / "manifest.json").write_bytes(m.to_json())
    return root / name


# (train images, stored side) -> (batch: the largest power of two <= 256 giving >= 8 steps per epoch,
# (global, local) view sides: 224/96 from 224 px up, else the image side and half of it).
@pytest.mark.parametrize("train, px, batch, views", [(1000, 500, 64, (224, 96)), (50_000, 32, 256, (32, 16)),
                                                     (40, 48, 4, (48, 24)), (100_000, 96, 256, (96, 48))])
def test_a_dataset_without_preset_trains_on_what_its_manifest_decides(tmp_path, train, px, batch, views) -> None:
    write_manifest(tmp_path, "mine", train=train, px=px)
    cfg = load_config(["method=byol", "data=mine", f"data.root={tmp_path}"])
    assert cfg.data.name == "mine" and cfg.data.num_classes == 7
    assert (cfg.views.global_px, cfg.views.local_px) == views
    assert cfg.data.batch_size == batch
    epoch = train // batch
    assert (cfg.optim.steps, cfg.optim.warmup_steps) == (100 * epoch, 10 * epoch)
    # A named preset overrides what was derived (not the class count: a fact of the data); the CLI beats both.
    named = load_config(["method=byol", "data=mine", "preset=cifar10", f"data.root={tmp_path}", "optim.steps=5"])
    assert (named.data.name, named.data.num_classes, named.data.batch_size) == ("mine", 7, 512)
    assert named.model.backbone == "resnet18" and named.optim.steps == 5


@pytest.mark.parametrize("preset", sorted(p.stem for p in (ROOT / "train" / "configs" / "data").glob("*.yaml")))
def test_every_data_preset_sets_every_derived_value(preset: str) -> None:
    """So that a named preset trains the same whether or not its dataset folder exists yet."""
    import yaml

    from train.resolve import DERIVED_KEYS

    tree = yaml.safe_load((ROOT / "train" / "configs" / "data" / f"{preset}.yaml").read_text())
    instead = {"optim.steps": "optim.epochs", "optim.warmup_steps": "optim.warmup_epochs"}   # per run instead
    for key in DERIVED_KEYS:
        section, name = key.split(".")
        other = instead.get(key, key).split(".")[1]
        assert name in tree.get(section, {}) or other in tree.get(section, {}), key


def test_unknown_or_unusable_datasets_are_one_line_errors(tmp_path) -> None:
    with pytest.raises(ConfigError, match=r"no dataset 'nope'.*--name nope.*cifar10, cifar100, imagenet, synthetic"):
        load_config(["method=rsa", "data=nope", f"data.root={tmp_path}"])
    with pytest.raises(ConfigError, match=r"no data preset 'cifar11'; choose one of cifar10"):
        load_config(["method=rsa", "data=synthetic", "preset=cifar11"])
    (tmp_path / "half").mkdir()                         # interrupted preprocessing: no manifest
    with pytest.raises(ConfigError, match=r"incomplete.*make preprocess"):
        load_config(["method=rsa", "data=half", f"data.root={tmp_path}"])
    write_manifest(tmp_path, "empty", train=1, px=64)
    with pytest.raises(ConfigError, match=r"'empty' has 1 train images.*re-run make preprocess"):
        load_config(["method=rsa", "data=empty", f"data.root={tmp_path}"])


@pytest.mark.parametrize("world", [1, 8, 64])
def test_the_imagenet_preset_is_a_per_gpu_batch_that_fits_on_any_number_of_gpus(tmp_path, world: int) -> None:
    """256 images per GPU for every method (what `python -m train.memory` estimates to fit 80 GB: 342 for
    relicv2's six views, 718 for the two-view methods); the global batch, the scaled lr and the steps
    follow the number of GPUs, the length stays 1000 epochs."""
    from train.schedules import scaled_lr

    write_manifest(tmp_path, "imagenet", train=1_281_167, px=500, classes=1000)
    for method in ("relicv2", "byol", "uota"):
        cfg = load_config([f"method={method}", "data=imagenet", f"data.root={tmp_path}"], world_size=world)
        assert cfg.data.batch_size == 256 * world and cfg.data.batch_size // world == 256
        assert scaled_lr(cfg.optim.lr, cfg.data.batch_size) == pytest.approx(0.2 * world)
        steps_per_epoch = 1_281_167 // (256 * world)
        assert (cfg.optim.steps, cfg.optim.warmup_steps) == (1000 * steps_per_epoch, 10 * steps_per_epoch)
    with pytest.raises(ConfigError, match=r"a batch of 512 per GPU is more than the 342 .*data.batch_size=342/gpu or less"):
        load_config(["method=relicv2", "data=imagenet", f"data.root={tmp_path}", "data.batch_size=512/gpu"], world_size=world)
    assert load_config(["method=byol", "data=imagenet", f"data.root={tmp_path}", "data.batch_size=512/gpu"],
                       world_size=world).data.batch_size == 512 * world
    # One key: the user's own global batch replaces the preset's per-GPU one; steps win over epochs.
    own = load_config(["method=byol", "data=imagenet", f"data.root={tmp_path}", f"data.batch_size={128 * world}",
                       "optim.steps=77"], world_size=world)
    assert (own.data.batch_size, own.optim.steps) == (128 * world, 77)


def test_a_checkpoint_is_checked_for_the_network_it_builds_keys_added_since_taking_their_defaults() -> None:
    """`check_same_network`: a saved config of another layout is a one-line error naming the key; a
    config saved before a layout key existed (`model.proj_last_bn`) reads as that key's default."""
    from train.run import check_same_network

    byol = load_config(["method=byol", "data=synthetic"])
    saved = to_dict(byol)
    check_same_network(byol, saved, "ck.pt", "fix")
    del saved["model"]["proj_last_bn"]                                    # written before the key existed
    check_same_network(byol, saved, "ck.pt", "fix")
    mocov3 = to_dict(load_config(["method=mocov3", "data=synthetic"]))
    del mocov3["model"]["proj_last_bn"]
    with pytest.raises(ConfigError, match=r"model.proj_last_bn=False \(asked for True\)"):
        check_same_network(load_config(["method=mocov3", "data=synthetic"]), mocov3, "ck.pt", "fix")
    with pytest.raises(ConfigError, match=r"checkpoint ck.pt was trained with method=byol \(asked for mocov3\)"):
        check_same_network(load_config(["method=mocov3", "data=synthetic"]), to_dict(byol), "ck.pt", "fix")


def test_a_retired_key_at_its_old_default_is_dropped_and_set_otherwise_is_refused(tmp_path) -> None:
    """A run's config.yaml written while `data.parallel_gpu_ops` and `data.sequence_views` existed (both
    `false` unless set), or a checkpoint of that time, still loads; one that turned either on is refused with the reason, the
    way every unknown key is."""
    base = load_config(["method=simclr"])
    saved = tmp_path / "config.yaml"
    saved.write_text("data:\n  parallel_gpu_ops: false\n  sequence_views: false\n  num_workers: 3\n")
    cfg = load_config(["method=simclr", f"config={saved}"])
    assert cfg.data.num_workers == 3 and to_dict(cfg) == to_dict(dataclasses.replace(
        base, data=dataclasses.replace(base.data, num_workers=3), layers=cfg.layers))
    old = to_dict(base)                                       # a checkpoint's config of that time
    old["data"] |= {"parallel_gpu_ops": False, "sequence_views": False}
    assert to_dict(config_from_dict(old)) == to_dict(base)
    for key in ("parallel_gpu_ops", "sequence_views"):
        with pytest.raises(ConfigError, match=f"data.{key}' was removed .*not faster on a GPU.*; remove it"):
            load_config(["method=simclr", f"data.{key}=true"])
    with pytest.raises(ConfigError, match="unknown"):
        load_config(["method=simclr", "data.parallel_gpu_opz=false"])


def test_uota_takes_table_s1_s_tau_of_its_base_unless_given() -> None:
    """Supplement Table S.1, its tau row in order of its models: BYOL+UOTA 250, MoCo-v2*+UOTA 200."""
    assert load_config(["method=uota", "data=synthetic"]).objective.tau == 250.0
    star = ["method=uota", "data=synthetic", "objective.base=mocov2star", "views.recipe=multicrop8",
            "model.pred_hidden=0", "model.proj_out=128"]
    assert load_config(star).objective.tau == 200.0
    assert load_config([*star, "objective.tau=300"]).objective.tau == 300.0


def test_a_setup_is_named_by_config_and_spells_out_the_paper_s_setting() -> None:
    """`config=uota-mocov2star` (train/configs/setups/): MoCo-v2*+UOTA as the supplement trains it (Sec. S.5:
    SwAV's multi-crop and LARS at 2.0 at batch 128, cosine to 0.002; Table S.1's tau 200)."""
    cfg = load_config(["config=uota-mocov2star", "data=synthetic"])
    assert (cfg.method, cfg.objective.base, cfg.objective.tau, cfg.views.recipe) == ("uota", "mocov2star", 200.0, "multicrop8")
    assert (cfg.model.pred_hidden, cfg.model.proj_out) == (0, 128)
    assert (cfg.optim.name, cfg.optim.lr, cfg.optim.min_lr_ratio, cfg.optim.weight_decay) == ("lars", 4.0, 0.001, 1e-6)
    with pytest.raises(ConfigError, match=r"no such file or setup; .*setups: uota-mocov2star$"):
        load_config(["config=uota-mocov2", "data=synthetic"])


def test_the_dali_graph_settings_reach_the_training_loader(tiny_args, tmp_path, monkeypatch) -> None:
    """`data.gpu_blur` and `data.graph_dtype` (the GPU graph's options the GPU check measures) are the
    training loader's; another value is a one-line error naming the choices."""
    import torch

    from pipelines.views import load_recipe
    from train import setup

    cfg = load_config(tiny_args("byol", tmp_path, "data.gpu_blur=filter", "data.graph_dtype=uint8"))
    seen = []
    monkeypatch.setattr(setup, "build_loader", lambda backend, spec: seen.append(spec))
    setup.build_train_loader(cfg, load_recipe(cfg.views.recipe, 32, 16), "dali", torch.device("cpu"))
    assert (seen[0].gpu_blur, seen[0].graph_dtype) == ("filter", "uint8")
    assert (Config().data.gpu_blur, Config().data.graph_dtype) == ("gaussian", "float32")
    with pytest.raises(ConfigError, match=r"'data.graph_dtype': 'float16' is not a valid choice; choose one of float32, uint8"):
        load_config(tiny_args("byol", tmp_path, "data.graph_dtype=float16"))
