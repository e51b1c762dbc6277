"""Config <-> CLI: names match the registries, flags are generated and grouped, bad values fail."""

import dataclasses

import pytest

import jaxdp
from jaxdp import config, registry
from jaxdp.config import Config, ConfigError, build_parser, parse_args


def test_choices_are_the_registries_names():
    parser = build_parser()
    choices = {action.dest: tuple(action.choices) for action in parser._actions if action.choices}
    assert choices == {"strategy": tuple(registry.STRATEGIES),
                       "optimizer": tuple(registry.OPTIMIZERS), "schedule": tuple(registry.SCHEDULES),
                       "outer_optimizer": tuple(registry.OUTER_OPTIMIZERS),
                       "precision": ("fp32", "bf16", "fp8"), "attention": ("auto", "xla", "cudnn"), "kernels": ("auto", "xla", "pallas"),
                       "hierarchy": ("auto", "flat"), "weight_decay_on": ("matrices", "all"), "muon_on": ("hidden", "all")}
    assert tuple(jaxdp.STRATEGIES) == ("psum", "ring", "host")
    model_help = next(a.help for a in parser._actions if a.dest == "model")  # --model also takes MODULE:ATTR
    assert all(name in model_help for name in registry.MODELS) and "MODULE:ATTR" in model_help
    assert jaxdp.STRATEGIES["ring"] is jaxdp.sync.collectives.RING and jaxdp.STRATEGIES["ring"].mean is jaxdp.ring_mean  # lazily


def test_every_field_is_a_flag_in_a_group_and_help_shows_defaults():
    text = build_parser().format_help()
    for field in dataclasses.fields(Config):
        assert f"--{field.name.replace('_', '-')}" in text
    for group in config.GROUPS:
        assert f"{group}:" in text
    assert "(default: psum)" in " ".join(text.split())
    assert "(default: None)" not in text


def help_text(flag, capsys):
    with pytest.raises(SystemExit) as info:
        parse_args([flag])
    assert info.value.code == 0
    return capsys.readouterr().out


def test_help_lists_the_common_flags_first_and_names_every_other_one(capsys):
    lines = help_text("--help", capsys).splitlines()
    assert lines[0].startswith("usage: ") and lines[4] == "common:" and len(lines) <= 40, len(lines)
    common = [line.split()[0] for line in lines[5:] if line.startswith("  --")][:len(config.COMMON)]
    assert common == [f"--{name.replace('_', '-')}" for name in config.COMMON]
    for name in config.COMMON:  # one line each, its default on it
        line = next(line for line in lines if line.startswith(f"  --{name.replace('_', '-')} "))
        default = getattr(Config(), name)
        assert default is None or f"(default: {default})" in line, line
    words = {w for line in lines for w in line.split()}
    for field in dataclasses.fields(Config):
        assert f"--{field.name.replace('_', '-')}" in words, field.name
    assert {"--config", "--help-all"} <= words


def test_help_all_gives_every_field_its_meaning_and_default(capsys):
    text = " ".join(help_text("--help-all", capsys).split())
    for field in dataclasses.fields(Config):
        meaning = " ".join(field.metadata["help"].split()[:6])
        assert f"--{field.name.replace('_', '-')}" in text and meaning in text, field.name
        assert field.default is None or f"(default: {field.default})" in text, field.name
    assert all(f" {group}: --" in text for group in config.GROUPS)


def test_parse_defaults_and_values():
    assert parse_args([]) == Config()
    cfg = parse_args(["--strategy=ring", "--batch-size", "64", "--lr", "0.1", "--no-progress"])
    assert (cfg.strategy, cfg.batch_size, cfg.lr, cfg.progress) == ("ring", 64, 0.1, False)


@pytest.mark.parametrize("argv, needle", [
    (["--strategy", "tree"], "invalid choice"),
    (["--batch-size", "0"], "--batch-size must be a positive integer"),
    (["--steps", "-1"], "--steps must be 0 or more"),
    (["--lr", "nan"], "--lr must be a positive number"),
    (["--lr", "0"], "--lr must be a positive number"),
    (["--devices", "0"], "--devices must be a positive integer"),
    (["--process-id", "2", "--num-processes", "2"], "--process-id=2 must be smaller"),
    (["--dataset", "mnist"], "neither a built-in dataset"),
    (["--bogus"], "unrecognized arguments"),
])
def test_bad_values_raise_one_sentence(argv, needle):
    with pytest.raises(ConfigError, match=needle.replace("(", r"\(")) as info:
        parse_args(argv)
    assert "\n" not in str(info.value)


def test_warmup_is_checked_against_the_schedule_s_horizon():
    """A long schedule trained in short chunks: --warmup-steps belongs to --schedule-steps, not --steps."""
    flags = ["--schedule", "warmup-cosine", "--warmup-steps", "100"]
    chunk = parse_args([*flags, "--steps", "20", "--schedule-steps", "1000"])
    assert (chunk.steps, chunk.schedule_steps, chunk.warmup_steps) == (20, 1000, 100)
    with pytest.raises(ConfigError, match=r"--warmup-steps=100 must be smaller than the schedule's horizon, "
                                          r"--schedule-steps=50$"):
        parse_args([*flags, "--steps", "1000", "--schedule-steps", "50"])
    with pytest.raises(ConfigError, match=r"--warmup-steps=100 must be smaller than the schedule's horizon, --steps=20$"):
        parse_args([*flags, "--steps", "20"])


def test_head_bias_and_the_defaults_of_checkpoints_that_do_not_record_it():
    from jaxdp.checkpoint.resume import with_recorded_defaults

    gpt = parse_args(["--model", "gpt", "--dataset", "corpus.txt"])
    assert gpt.head_bias is False and parse_args(["--model", "gpt", "--dataset", "c.txt", "--head-bias"]).head_bias
    with pytest.raises(ConfigError, match="--head-bias adds a bias to the output layer of --model gpt trained from "
                                          "scratch; not --model=mlp"):
        parse_args(["--head-bias"])
    old = {k: v for k, v in gpt.to_dict().items() if k != "head_bias"}  # written before the field existed
    assert with_recorded_defaults(gpt, old) == (gpt.replace(head_bias=True), ["--head-bias"])
    assert with_recorded_defaults(gpt, gpt.to_dict()) == (gpt, [])  # recorded: as it says (a mismatch is refused)
    assert with_recorded_defaults(gpt, None) == (gpt, [])  # no checkpoint: a new run
    mlp = parse_args([])
    assert with_recorded_defaults(mlp, {k: v for k, v in mlp.to_dict().items() if k != "head_bias"}) == (mlp, [])
