"""The hidden stage's fused forward: norms, SiLU-MLPs and rotary swapped for single-kernel
versions only where they compute exactly what transformers' code does, and put back after."""

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from draftsmith.hidden.fused_forward import fused

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


def tiny(model_type: str, device="cpu", dtype=torch.float32, **extra):
    config = AutoConfig.for_model(model_type, hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=3, num_attention_heads=4,
                                  num_key_value_heads=2, head_dim=16, vocab_size=97, **extra)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config).eval().to(device, dtype)
    for name, p in model.named_parameters():  # norms start at 1 (or 0): make them tell apart
        if p.dim() == 1:
            torch.nn.init.normal_(p, 0.5, 0.2)
    return model


def own_forwards(model) -> list[str]:
    return [n for n, m in model.named_modules() if "forward" in m.__dict__]


@pytest.mark.parametrize("model_type, norms", [("qwen3", 4 * 3 + 1), ("llama", 2 * 3 + 1)])
def test_fused_expressions_replace_the_models_own_and_compute_the_same(model_type, norms):
    import sys

    model = tiny(model_type)
    home = sys.modules[type(model).__module__]
    rotary = home.apply_rotary_pos_emb
    ids = torch.randint(0, 97, (2, 11))
    with torch.no_grad():
        want = model(ids).logits
        with fused(model, eager=True) as swapped:
            assert swapped == {"rms_norm": norms, "silu_mul": 3, "rotary": 1}
            assert home.apply_rotary_pos_emb is not rotary
            got = model(ids).logits
        assert torch.equal(got, want)
        assert own_forwards(model) == [] and home.apply_rotary_pos_emb is rotary  # put back
        with pytest.raises(KeyError), fused(model, eager=True):
            raise KeyError("interrupted")
        assert own_forwards(model) == [] and home.apply_rotary_pos_emb is rotary


def test_a_norm_or_mlp_of_another_form_keeps_its_own_code():
    """Gemma: the norm scales by 1 + weight, the MLP's gate is GELU: neither is swapped (the
    probe tells them apart, not their names); its rotary is the usual one and is."""
    model = tiny("gemma")
    ids = torch.randint(0, 97, (1, 9))
    with torch.no_grad():
        want = model(ids).logits
        with fused(model, eager=True) as swapped:
            assert swapped == {"rotary": 1}
            assert torch.equal(model(ids).logits, want)


def test_a_cpu_keeps_transformers_forward():
    model = tiny("qwen3")
    with fused(model) as swapped:
        assert swapped == {} and own_forwards(model) == []


@cuda
@pytest.mark.parametrize("model_type", ["qwen3", "llama"])
def test_compiled_kernels_capture_the_states_transformers_does(model_type):
    """On a GPU: the packed capture with the compiled kernels against the same capture with
    transformers' own code, bf16, samples of several lengths (one compile for all of them)."""
    from draftsmith.capture import capture_flat, set_attention

    model = tiny(model_type, "cuda", torch.bfloat16)
    set_attention(model, "auto")
    g = torch.Generator().manual_seed(1)
    samples = [[torch.randint(0, 97, (n,), generator=g).cuda() for n in lengths]
               for lengths in ([40, 3, 17], [129, 64], [5])]
    with torch.no_grad():
        want = [capture_flat(model, s, [0, 1, 2]) for s in samples]
        with fused(model) as swapped:
            assert swapped["rms_norm"] > 0 and swapped["silu_mul"] == 3 and swapped["rotary"] == 1
            got = [capture_flat(model, s, [0, 1, 2]) for s in samples]
    for (aux, final), (aux_ref, final_ref) in zip(got, want):
        for x, ref in ((aux, aux_ref), (final, final_ref)):
            scale = ref.float().abs().amax()
            assert (x.float() - ref.float()).abs().max() <= scale * 2**-6
