"""The loss catalogue (what the config validator reads, without torch) agrees with the registered functions."""
from __future__ import annotations

import pytest

from offpolicy_moe.losses import catalogue, get_loss_spec, list_policy_losses, register_policy_loss, registry
from offpolicy_moe.losses.catalogue import BUILTIN_LOSSES, LossInterface, loss_interface

FIELDS = ("clips", "sequence_level", "runtime", "check_options", "has_global_pass", "global_pass_when")


@pytest.mark.parametrize("name", sorted(BUILTIN_LOSSES))
def test_each_builtin_registers_what_the_catalogue_declares(name):
    declared = BUILTIN_LOSSES[name][1]
    spec = get_loss_spec(name)
    assert spec.fn is not None and spec.reference is not None
    assert list(spec.option_defaults.items()) == list(declared.option_defaults.items())
    assert {f: getattr(spec, f) for f in FIELDS} == {f: getattr(declared, f) for f in FIELDS}
    assert loss_interface(name) is spec        # once loaded, the catalogue answers with the registered entry


def test_the_catalogue_lists_the_registered_builtins():
    assert set(BUILTIN_LOSSES) <= set(list_policy_losses())


def test_a_function_whose_options_differ_from_its_declaration_is_refused():
    def grpo_with_other_options(logp, old_logp, advantages, mask, *, agg=None, weights=None, num_tokens=None,
                                num_seqs=None, norm_length=None, clip=0.2):
        raise AssertionError("never called")

    with pytest.raises(TypeError, match="built-in loss 'grpo' takes the options"):
        registry.register_builtin_loss("grpo")(grpo_with_other_options)


def test_a_registered_loss_is_declared_to_the_catalogue_and_forgotten_when_unregistered():
    @register_policy_loss("test_catalogue_scaled", clips=True)
    def scaled(logp, old_logp, advantages, mask, *, agg=None, weights=None, num_tokens=None, num_seqs=None,
               norm_length=None, scale: float = 1.0):
        raise AssertionError("never called")

    try:
        interface = loss_interface("test_catalogue_scaled")
        assert isinstance(interface, LossInterface) and interface.clips and interface.options == ("scale",)
        assert catalogue.loss_options_problem("test_catalogue_scaled", {"scale": 2.0}) is None
    finally:
        registry.unregister_policy_loss("test_catalogue_scaled")
    assert "test_catalogue_scaled" not in list_policy_losses()
    with pytest.raises(ValueError, match="unknown policy loss 'test_catalogue_scaled'"):
        loss_interface("test_catalogue_scaled")
