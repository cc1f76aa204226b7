"""``model.gradient_checkpointing``: parsing of true / false / auto, and ``auto`` turning
recomputation on in a built trainer when a micro-batch would not fit."""

from __future__ import annotations

import logging

import pytest

from policygrad.config.train import ConfigError, load_config
from policygrad.trainer.factory import build_trainer


@pytest.mark.unit
@pytest.mark.parametrize("given, parsed", [(True, True), (False, False), ("auto", "auto"), ("true", True)])
def test_true_false_and_auto_parse(given, parsed):
    cfg = load_config(
        None,
        {"model": {"gradient_checkpointing": given}}
        if given != "true"
        else ["--model.gradient_checkpointing=true"],
    )
    assert cfg.model.gradient_checkpointing == parsed and type(cfg.model.gradient_checkpointing) is type(
        parsed
    )


@pytest.mark.unit
def test_default_is_auto_and_bad_values_are_refused():
    assert load_config(None, {}).model.gradient_checkpointing == "auto"
    with pytest.raises(
        ConfigError, match=r"model.gradient_checkpointing='sometimes' is not valid; choose auto"
    ):
        load_config(None, {"model": {"gradient_checkpointing": "sometimes"}})
    with pytest.raises(ConfigError, match="model.gradient_checkpointing"):
        load_config(None, {"model": {"gradient_checkpointing": 2}})
    # a number or null gets the same one message with the accepted values, not the field's Python type
    choices = "is not valid; choose auto (recompute only when the activations would not fit), true or false"
    for given in ("1", "null", "2.5"):
        with pytest.raises(ConfigError) as info:
            load_config(None, [f"--model.gradient_checkpointing={given}"])
        shown = {"1": "1", "null": "None", "2.5": "2.5"}[given]
        assert str(info.value) == f"model.gradient_checkpointing={shown} {choices}"
    # names are read as the other choices are: case and surrounding spaces forgiven
    assert load_config(None, ["--model.gradient_checkpointing=AUTO"]).model.gradient_checkpointing == "auto"


@pytest.mark.integration
def test_auto_turns_checkpointing_on_when_memory_is_short(make_config, monkeypatch, caplog):
    from policygrad.parallel import recompute

    monkeypatch.setitem(recompute.Recompute.__init__.__kwdefaults__, "read_available", lambda _device: 1_000)
    # every row forwarded: a step whose groups all scored alike would forward none
    trainer = build_trainer(make_config(steps=1, optim={"skip_zero_advantage_rows": False}))
    try:
        assert not getattr(trainer.policy, "is_gradient_checkpointing", False)
        with caplog.at_level(logging.WARNING, logger="policygrad"):
            trainer.step()
        assert trainer.policy.is_gradient_checkpointing and trainer.policy_step.recompute.enabled
        notes = [r.getMessage() for r in caplog.records if "turned recomputation on" in r.getMessage()]
        assert len(notes) == 1 and "GB available" in notes[0]
    finally:
        trainer.close()


@pytest.mark.integration
def test_auto_stays_off_when_memory_is_plenty(make_config, monkeypatch, caplog):
    from policygrad.parallel import recompute

    monkeypatch.setitem(recompute.Recompute.__init__.__kwdefaults__, "read_available", lambda _device: 10**15)
    trainer = build_trainer(make_config(steps=1))
    try:
        with caplog.at_level(logging.WARNING, logger="policygrad"):
            trainer.step()
        assert not trainer.policy.is_gradient_checkpointing and not trainer.policy_step.recompute.enabled
        assert not any("recomputation" in r.getMessage() for r in caplog.records)
    finally:
        trainer.close()
