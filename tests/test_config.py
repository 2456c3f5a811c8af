"""Configs: every preset loads and validates; bad input fails with a message
that names the value and the fix, before anything compiles."""

import json
import re
import shutil
import subprocess
import sys

import pytest

import train
from jaxtp.config import (Config, ConfigError, apply_overrides, load_config, preset_names,
                          validate)
from procs import ROOT, child_env


@pytest.mark.parametrize("name", preset_names())
def test_every_preset_loads_and_validates(name):
    cfg = validate(load_config(name))
    assert cfg.model.d_model % cfg.model.n_heads == 0
    tps = [t for t in (1, 2, 4, 8) if cfg.model.n_heads % t == 0 and cfg.model.d_ff % t == 0]
    assert max(tps) >= 4  # every preset is tensor-parallel beyond tp=2
    validate(apply_overrides(cfg, [f"parallel.tp={max(tps)}"]))


# Parameter counts published for these shapes: nanoGPT's GPT-2 124M with the
# vocabulary padded to 50304 (124,475,904 incl. position embeddings), Meta's
# Llama-3.2-1B (1,235,814,400, tied), Llama-3-8B (8,030,261,248) and
# Llama-3-70B (70,553,706,496), Mixtral-8x7B (46,702,792,704: "46.7B"),
# Qwen3-30B-A3B (30,532,122,624, which Qwen's model card rounds to "30.5B"
# total; its q/k norms, 2 x 128 per layer, included).
# Qwen3-235B-A22B (235,093,634,560: the model card's "235B"; its config's
# sizes are the preset's).
PUBLISHED = {"gpt2-small": 124_475_904, "llama-1b": 1_235_814_400,
             "llama3-8b": 8_030_261_248, "llama3-70b": 70_553_706_496,
             "mixtral-8x7b": 46_702_792_704, "qwen3-30b-a3b": 30_532_122_624,
             "qwen3-235b-a22b": 235_093_634_560}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_large_presets_have_their_published_parameter_counts(name):
    import jax

    from jaxtp.parallel import make_mesh
    from jaxtp.model.build import abstract_model

    _, abstract = abstract_model(load_config(name), make_mesh(1, 1))  # nothing allocated
    assert sum(x.size for x in jax.tree.leaves(abstract)) == PUBLISHED[name]


test_large_presets_have_their_published_parameter_counts.fast_cases = set(PUBLISHED) - {
    "llama3-70b", "mixtral-8x7b", "qwen3-30b-a3b", "qwen3-235b-a22b"}  # seconds each


def test_the_deepseek_v3_shape_is_its_published_size_but_for_its_attention():
    """deepseek-v3: DeepSeek-V3's MoE (61 layers, the first 3 dense, 256
    routed experts of 2048 and a shared one, top 8 of 4 of 8 groups by
    sigmoid) with jaxtp's attention (128 heads of 128, q/k/v/o 4 x 7168 x
    16384 a layer) in place of its multi-head latent attention (arXiv
    2412.19437 Sec. 2.1.1; its config: q rank 1536, kv rank 512, 128 + 64
    q/k dims a head, v 128, with 2 norms). With MLA's parameters in place of
    these, the count is the 671B of its main model (the model card: 685B
    with 14B of multi-token prediction, not built here); 37B of them act."""
    import jax

    from jaxtp.model.build import abstract_model
    from jaxtp.parallel import make_mesh

    cfg = load_config("deepseek-v3")
    m = cfg.model
    _, abstract = abstract_model(cfg, make_mesh(1, 1))
    total = sum(x.size for x in jax.tree.leaves(abstract))
    D, H = 7168, 128
    mla = (D * 1536 + 1536 + 1536 * H * (128 + 64) + D * (512 + 64) + 512
           + 512 * H * (128 + 128) + H * 128 * D)
    gqa = 4 * D * H * 128
    main = total - m.n_layers * (gqa - mla)
    assert main == 671_026_419_200 and round(main / 1e9) == 671
    active = main - (m.n_layers - 3) * (256 - 8) * 3 * D * m.moe_d_ff
    assert int(active / 1e9) == 37
    assert (m.moe_score, m.moe_groups, m.moe_group_top_k, m.moe_route_scale) == (
        "sigmoid", 8, 4, 2.5)


def test_a_mixture_of_experts_counts_its_active_parameters_in_mfu():
    """Mixtral 8x7B: 12.9B of its 46.7B parameters act on a token (Mistral AI's
    announcement: "46.7B total parameters but only uses 12.9B parameters per
    token"): 6 x those, less the input table's lookup, plus attention."""
    from jaxtp.hardware import model_flops_per_token

    cfg = load_config("mixtral-8x7b")
    m = cfg.model
    active = 46_702_792_704 - m.n_layers * (8 - 2) * 3 * m.d_model * m.d_ff
    assert round(active / 1e9, 1) == 12.9
    lookup = m.vocab_size * m.d_model
    assert model_flops_per_token(cfg, 46_702_792_704) == \
        6 * (active - lookup) + 12 * m.n_layers * m.d_model * m.seq_len


def test_qwen3_moe_counts_its_active_parameters_and_its_wider_attention():
    """Qwen3-30B-A3B: 8 of 128 experts act, 3,353,032,704 parameters, which the
    model card gives as "3.3B activated" (3.35B, cut at one decimal); its
    attention is 32 heads x 128 = 4096 wide at d_model 2048, so 12*L*h*s
    takes h = 4096."""
    from jaxtp.hardware import model_flops_per_token

    cfg = load_config("qwen3-30b-a3b")
    m = cfg.model
    assert (m.head_dim, m.n_heads * m.head_dim, m.d_model) == (128, 4096, 2048)
    active = PUBLISHED["qwen3-30b-a3b"] - m.n_layers * (128 - 8) * 3 * m.d_model * m.moe_d_ff
    assert active == 3_353_032_704
    lookup = m.vocab_size * m.d_model
    assert model_flops_per_token(cfg, PUBLISHED["qwen3-30b-a3b"]) == \
        6 * (active - lookup) + 12 * m.n_layers * 4096 * m.seq_len


def test_a_head_dim_of_its_own_frees_d_model_from_n_heads():
    """With model.d_head set, d_model need not divide by n_heads (the q and
    output projections are [D, N, H] and [N, H, D] whatever N * H is)."""
    cfg = validate(apply_overrides(Config(), ["model.d_model=100", "model.n_heads=8",
                                              "model.d_head=16"]))
    assert cfg.model.head_dim == 16
    assert apply_overrides(Config(), ["model.d_model=96", "model.n_heads=8"]).model.head_dim == 12


def test_presets_hold_what_their_names_promise():
    assert set(preset_names()) >= {"tiny", "gpt2-small", "llama-tiny", "llama-1b", "llama3-8b",
                                   "llama3-70b"}
    lt = load_config("llama-tiny").model
    assert (lt.style, lt.kv_heads, lt.tie_embeddings) == ("llama", 2, False)  # GQA
    validate(apply_overrides(load_config("tiny"), ["parallel.tp=8"]))  # README default
    g = load_config("gpt2-small").model
    assert (g.n_layers, g.d_model, g.n_heads, g.d_ff, g.seq_len) == (12, 768, 12, 3072, 1024)


def test_overrides_are_typed():
    cfg = apply_overrides(Config(), ["model.d_model=256", "train.lr=1e-3",
                                     "model.tie_embeddings=false", "parallel.impl=gspmd"])
    assert (cfg.model.d_model, cfg.train.lr, cfg.model.tie_embeddings) == (256, 1e-3, False)
    assert cfg.to_dict() == Config.from_dict(json.loads(json.dumps(cfg.to_dict()))).to_dict()


@pytest.mark.parametrize("overrides, match", [
    (["model.n_heads=6", "model.d_model=96", "parallel.tp=4"], r"model.n_heads=6 is not divisible by tp=4.*\[1, 2\]"),
    (["model.d_ff=100", "parallel.tp=8"], r"model.d_ff=100 is not divisible by tp=8"),
    (["train.batch_size=6", "parallel.dp=4"],
     r"train.batch_size=6 is not divisible by dp\*microbatches=4\*1"),
    (["train.batch_size=8", "parallel.dp=2", "train.microbatches=3"],
     r"train.batch_size=8 is not divisible by dp\*microbatches=2\*3; .* multiple of 6"),
    (["model.remat=some"], r"model.remat='some'; choose one of \('none', 'full', 'dots', 'minimal'\)"),
    (["model.attention=flash"], r"model.attention='flash'; choose one of \('auto', 'xla'"),
    (["model.loss_chunk=-1"], r"model.loss_chunk=-1 must be >= 0"),
    (["model.attention_block=0"], r"model.attention_block=0 must be positive"),
    (["parallel.fsdp=true", "parallel.dp=3", "train.batch_size=6"],
     r"parallel.fsdp splits model.d_model=128 over dp=3"),
    (["train.spike_factor=-1"], r"train.spike_factor=-1.0 must be finite and >= 0"),
    (["train.max_skipped_steps=0"], r"train.max_skipped_steps=0 must be positive"),
    (["model.n_layers=0"], r"model.n_layers=0 must be positive"),
    (["model.d_model=-8"], r"model.d_model=-8 must be positive"),
    (["parallel.tp=0"], r"parallel.tp=0 must be positive"),
    (["model.dropout=1.5"], r"model.dropout=1.5 must be in \[0, 1\)"),
    (["model.dtype=float8"], r"model.dtype='float8'; choose one of"),
    (["model.dtype=float64"], r"model.dtype='float64' with model.param_dtype='float32': "
     r"float64 is a verification mode of both, not a mixed precision"),
    (["train.grad_clip=nan"], r"train.grad_clip=nan must be finite and >= 0"),
    (["train.weight_decay=inf"], r"train.weight_decay=inf must be finite"),
    (["train.b2=1.0"], r"train.b2=1.0 must be in \[0, 1\)"),
    (["train.lr=nan"], r"train.lr=nan must be positive"),
    (["model.style=bert"], r"model.style='bert'; choose one of"),
    (["model.n_kv_heads=3"], r"model.n_kv_heads=3 must divide model.n_heads=8"),
    (["model.d_head=-1"], r"model.d_head=-1 must be >= 0 \(0: d_model // n_heads\)"),
    (["model.style=llama", "model.d_head=7"], r"rotary embeddings need an even head dim, got 7"),
    (["model.n_kv_heads=2", "model.n_heads=6", "model.d_model=96", "model.d_ff=96",
      "parallel.tp=3"],
     r"n_kv_heads=2 and tp=3: .*valid --tp: \[1, 2\]"),
    (["model.vocab_size=250", "model.vocab_multiple=2", "parallel.tp=8"],
     r"padded to 250 .* tp=8 does not divide"),
    (["model.d_model=100", "model.n_heads=8"], r"d_model=100 is not divisible by model.n_heads=8"),
    (["parallel.overlap=collective_matmul", "parallel.tp=8"],
     r"parallel.overlap='collective_matmul' overlaps sequence parallelism.*add --sp"),
    (["parallel.overlap=ring"],
     r"parallel.overlap='ring'; choose one of \('none', 'collective_matmul', "
     r"'collective_matmul_bidi'\)"),
    (["parallel.overlap=collective_matmul_bidi", "parallel.tp=8", "parallel.sp=true"],
     r"shard_map's bidirectional rings; under impl=gspmd XLA chooses .*--overlap "
     r"collective_matmul"),
    (["parallel.overlap=collective_matmul_bidi", "parallel.tp=8", "parallel.sp=true",
      "parallel.impl=shard_map", "model.seq_len=136"],
     r"halves of each rank's model.seq_len/tp = 136/8 .* a multiple of 16"),
])
def test_inconsistent_values_are_rejected(overrides, match):
    with pytest.raises(ConfigError, match=match):
        validate(apply_overrides(Config(), overrides))


@pytest.mark.parametrize("overrides, match", [
    (["model.d_modle=64"], r"unknown config key 'model.d_modle'.*d_model"),
    (["optim.lr=1"], r"section in"),
    (["model.d_model=big"], r"model.d_model='big': expected a int"),
    (["model.tie_embeddings=maybe"], r"expected a bool"),
    (["model.d_model"], r"must look like section.key=value"),
])
def test_bad_overrides_are_rejected(overrides, match):
    with pytest.raises(ConfigError, match=match):
        apply_overrides(Config(), overrides)


def test_bad_files_are_rejected(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"model": {"d_model": "64"}}))
    with pytest.raises(ConfigError, match=r"model.d_model must be int, got '64' \(str\)"):
        load_config(str(bad))
    bad.write_text(json.dumps({"model": {"n_layer": 2}}))
    with pytest.raises(ConfigError, match=r"unknown config key\(s\) \['model.n_layer'\]"):
        load_config(str(bad))
    bad.write_text(json.dumps({"model": {"n_layers": True}}))
    with pytest.raises(ConfigError, match="must be int, got True"):
        load_config(str(bad))
    bad.write_text("{not json")
    with pytest.raises(ConfigError, match="not valid JSON"):
        load_config(str(bad))
    with pytest.raises(ConfigError, match=r"presets: \[.*'tiny'"):
        load_config("no-such-preset")


def test_a_file_that_is_no_config_is_refused_naming_it(tmp_path):
    """Bytes that are not UTF-8 (decoding's own error names no file) and JSON
    that is not an object: each a ConfigError that starts with the path."""
    bad = tmp_path / "bad.json"
    bad.write_bytes(b'{"model": {"n_layers": 2}}\xff')
    with pytest.raises(ConfigError, match=f"^{bad} is not UTF-8 text \\(byte 0xff at offset "
                                          "26\\): a config is a JSON file$"):
        load_config(str(bad))
    for text, what in (("5", "int"), ("null", "NoneType"), ("[1]", "list")):
        bad.write_text(text)
        with pytest.raises(ConfigError, match=f"^{bad}: a config must be a JSON object, got "
                                              f"{what}$"):
            load_config(str(bad))


def test_ring_attention_is_refused_where_it_was_asked_for_at_cp_1():
    """What a command line asked for is held to having an effect; a stored
    config (a run resumed from cp=4 ring to cp=1) keeps its ring, unasked."""
    from jaxtp.checks import check_asked

    ring1 = apply_overrides(Config(), ["parallel.cp_attention=ring"])
    with pytest.raises(ConfigError, match="parallel.cp=1 has none: add --cp N"):
        check_asked(ring1, {"parallel.cp_attention"})
    assert check_asked(ring1, {"parallel.cp"}) is ring1  # kept from the run, not asked
    ring2 = apply_overrides(ring1, ["parallel.cp=2"])
    assert check_asked(ring2, {"parallel.cp_attention", "parallel.cp"}) is ring2
    gather1 = Config()
    assert check_asked(gather1, {"parallel.cp_attention"}) is gather1  # the default


@pytest.mark.parametrize("over, asked, refused", [
    (["parallel.pp_schedule=1f1b"], "parallel.pp_schedule", "--pp-schedule 1f1b) orders a "
     "pipeline's microbatches, and parallel.pp=1 has no stages"),
    (["parallel.cp_balance=false"], "parallel.cp_balance", "parallel.cp=1 has none"),
    (["model.capacity_factor=2"], "model.capacity_factor", "acts on a mixture of experts"),
    (["model.moe_z_coef=0"], "model.moe_z_coef", "acts on a mixture of experts"),
    (["parallel.pp_schedule=gpipe"], "parallel.pp_schedule", None),  # the default: no effect
    (["parallel.pp_schedule=1f1b", "parallel.pp=2", "train.microbatches=2"],
     "parallel.pp_schedule", None),
    (["model.capacity_factor=2", "model.n_experts=8"], "model.capacity_factor", None),
    (["parallel.pp_schedule=1f1b"], "parallel.tp", None),  # kept from a run, not asked
])
def test_a_key_asked_for_where_it_acts_on_nothing_is_refused(over, asked, refused):
    from jaxtp.checks import check_asked

    cfg = validate(apply_overrides(Config(), over))
    if refused is None:
        assert check_asked(cfg, {asked}) is cfg
    else:
        with pytest.raises(ConfigError, match=re.escape(refused)):
            check_asked(cfg, {asked})


@pytest.mark.parametrize("over, match", [
    (["model.n_layers=2147483648"], "model.n_layers=2147483648 is past the largest size"),
    (["train.batch_size=" + "1" + "0" * 21], "is past the largest size jaxtp takes, 2**31 - 1"),
    (["model.moe_balance_coef=-0.5"], "model.moe_balance_coef=-0.5 must be finite and >= 0"),
    (["model.rope_theta=inf"], "model.rope_theta=inf must be positive and finite"),
    (["model.ln_eps=0"], "model.ln_eps=0.0 must be positive and finite"),
    (["train.checkpoint_minutes=nan"], "train.checkpoint_minutes=nan must be finite and >= 0"),
    (["parallel.pp_repeats=0"], "parallel.pp_repeats=0 must be positive"),
    (["model.moe_top_k=-1"], "model.moe_top_k=-1 must be >= 0"),
    (["train.sample_every=-1"], "train.sample_every=-1 must be >= 0 (0: off)"),
    (["train.seed=-1"], "train.seed=-1 must be in [0, 2**63)"),
    ([f"train.seed={2**63}"], "must be in [0, 2**63)"),
])
def test_every_number_is_range_checked(over, match):
    with pytest.raises(ConfigError, match=re.escape(match)):
        validate(apply_overrides(Config(), over))


def test_an_unknown_key_is_answered_with_the_closest():
    for key, said in (("model.capacity_factr=1", "did you mean model.capacity_factor?"),
                      ("train.batch=2", "did you mean train.batch_size?"),
                      ("model.zzz=1", "the fields of ModelConfig in jaxtp/config.py")):
        with pytest.raises(ConfigError, match=re.escape(said)):
            apply_overrides(Config(), [key])


def test_the_device_count_refusal_names_every_axis_asked():
    from jaxtp.parallel.distributed import check_device_count

    with pytest.raises(ValueError, match="lower --pp/--ep/--tp"):
        check_device_count({"pp": 2, "dp": 1, "ep": 2, "cp": 1, "tp": 4}, 8, "cpu")


@pytest.mark.parametrize("argv, match", [
    (["--tp", "3"], "model.n_heads=8 is not divisible by tp=3"),
    (["--cp-attention", "ring"], "config error: parallel.cp_attention='ring' (--cp-attention "
     "ring) passes K/V chunks between the cp ranks, and parallel.cp=1 has none"),
    (["--plan", "parallel.cp_attention=ring"], "parallel.cp=1 has none: add --cp N (N > 1)"),
    (["--tp", "8", "model.d_ff=12"], "model.d_ff=12 is not divisible by tp=8"),
    (["--dp", "3"], "train.batch_size=16 is not divisible by dp*microbatches=3*1"),
    (["model.heads=4"], "unknown config key 'model.heads'"),
    (["--tp", "8", "--dp", "2"], "16 devices requested but this machine has 8 cpu device"),
    (["--tp", "2", "--until", "0"], "--until 0: the step to stop after must be >= 1"),
    (["--tp", "2", "--inject-nan-at", "3,x"], "expected step numbers like 3 or 3,7"),
    (["--bf16", "--float64"], "--bf16 and --float64 ask for two precisions; choose one"),
    (["--tp", "2", "--resume"], "--resume needs --out"),
    (["--resume", "--plan", "--out", "x"], "--plan and --compare-hlo do not train"),
    (["--tp", "2", "--peak-tflops", "-5"], "'-5': expected a positive float"),
    (["--tp", "2", "--data", "/"], "--data / is a directory: give one text, token or .bin file"),
    (["--tp", "2", "--out", "/dev/null"], "--out /dev/null is a file, not a directory"),
    (["--tp", "8", "--overlap", "collective_matmul"], "it is built for SP only (a region's "
     "one all-reduce is not decomposed): add --sp, or --overlap none"),
])
def test_cli_rejects_bad_input_before_compiling(argv, match, tmp_path, capsys):
    if "--resume" not in argv and "--out" not in argv:
        argv = argv + ["--out", str(tmp_path / "run")]
    try:
        assert train.main(argv) == 2
    except SystemExit as e:  # argparse's own errors
        assert e.code == 2
    assert match in capsys.readouterr().err
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


@pytest.mark.slow
def test_cli_trains_and_writes_run_files(tmp_path, capsys):
    out = tmp_path / "run"
    argv = ["--tp", "2", "--steps", "4", "--out", str(out), "model.n_layers=1",
            "model.seq_len=32", "train.log_every=2", "train.eval_every=4",
            "train.eval_batches=1", "train.batch_size=4"]
    assert train.main(argv) == 0
    printed = capsys.readouterr().out
    assert "CPU devices" in printed and "step     4/4" in printed
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["parallel"]["tp"] == 2 and cfg["model"]["n_layers"] == 1
    rows = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2, 4]
    assert rows[0]["tokens_per_sec"] is None and rows[1]["tokens_per_sec"] > 0
    # nothing already saved is lost: the same --out is refused
    assert train.main(argv) == 2
    assert "already holds a run" in capsys.readouterr().err
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 3


def test_help_shows_each_flags_config_key_and_default(capsys):
    with pytest.raises(SystemExit):
        train.parse_args(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "[parallel.tp; default: the config's, 1 in tiny]" in text
    assert "[train.checkpoint_every; default: the config's, 100 in tiny]" in text
    assert "(default: 300" in text  # --coordinator-timeout
    assert "(step 2: step 1 runs at lr 0)" in text  # --check


@pytest.mark.slow
def test_a_wheel_install_has_its_presets(tmp_path):
    """`pip install .` (not editable): the presets are package data, and
    train.py runs from another directory against the installed package."""
    site, elsewhere, src = tmp_path / "site", tmp_path / "elsewhere", tmp_path / "src"
    # a copy: setuptools builds in the source tree (build/), which stays out of the repo
    shutil.copytree(ROOT, src, ignore=shutil.ignore_patterns(
        ".*", "build", "runs", "*.egg-info", "__pycache__", "tests"))
    r = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--target",
                        str(site), str(src)], capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert sorted(p.stem for p in (site / "jaxtp" / "configs").glob("*.json")) == preset_names()
    # pyproject lists the packages by name: every one of them is installed
    packages = lambda root: {p.parent.relative_to(root) for p in (root / "jaxtp").rglob(
        "__init__.py") if "__pycache__" not in p.parts}
    assert packages(ROOT) <= packages(site)
    elsewhere.mkdir()
    shutil.copy(ROOT / "train.py", elsewhere)  # no jaxtp/ beside it: the installed one
    env = child_env() | {"PYTHONPATH": str(site)}
    r = subprocess.run([sys.executable, "train.py", "--steps", "2", "--config", "llama-tiny",
                        "--out", "run", "train.log_every=1", "model.n_layers=1"], cwd=elsewhere,
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "step     2/2" in r.stdout
    assert json.loads((elsewhere / "run" / "config.json").read_text())["model"]["style"] == "llama"


def test_a_float64_model_is_refused_without_jax_64_bit_types():
    """Without jax_enable_x64 every float64 is float32: a float64 model would
    silently be an fp32 one; refused, naming the switch (train.py sets it)."""
    from jaxtp.model.build import abstract_model
    from jaxtp.parallel import make_mesh

    cfg = validate(apply_overrides(Config(), ["model.dtype=float64",
                                              "model.param_dtype=float64"]))
    with pytest.raises(ValueError, match=r"needs JAX's 64-bit types: call jax.config.update\("
                       r"'jax_enable_x64', True\) .*\(train.py does it for --float64\)"):
        abstract_model(cfg, make_mesh(1, 1))


def test_a_stored_config_with_a_renamed_key_loads_under_its_new_name():
    """A run saved before model.first_k_dense became model.moe_first_dense
    resumes with its value; on a command line the old name is unknown and
    the error offers the new one."""
    cfg = Config.from_dict({"model": {"first_k_dense": 1, "n_experts": 4, "n_layers": 3}})
    assert cfg.model.moe_first_dense == 1
    with pytest.raises(ConfigError, match="did you mean model.moe_first_dense"):
        apply_overrides(load_config("moe-tiny"), ["model.first_k_dense=1"])
    with pytest.raises(ConfigError, match="both model.first_k_dense and its new name"):
        Config.from_dict({"model": {"first_k_dense": 1, "moe_first_dense": 2}})
