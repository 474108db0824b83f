# rmsnorm.torch.patch on small random Hugging Face models built from configs (no download):
# float32 logits and every parameter's gradient match the unpatched model; in bfloat16 every
# swapped module's output is within one ulp of the original's on the same input and equal in
# at least 99% of elements; same Parameter objects and state_dict keys; every class in the
# convention table matches the installed transformers' module; unknown classes are left alone.
import copy
import importlib

import ml_dtypes
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")
rt = importlib.import_module("rmsnorm.torch")
patching = importlib.import_module("rmsnorm._torch_patch")

import oracle  # noqa: E402

SMALL = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 128,
    "max_position_embeddings": 64,
}
# name -> (config class, model class, RMSNorm modules in a model of 2 layers)
MODELS = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", 2 * 2 + 1),
    "mistral": ("MistralConfig", "MistralForCausalLM", 2 * 2 + 1),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", 2 * 2 + 1),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", 2 * 4 + 1),  # + q_norm, k_norm
    "gemma": ("GemmaConfig", "GemmaForCausalLM", 2 * 2 + 1),
    "gemma2": ("Gemma2Config", "Gemma2ForCausalLM", 2 * 4 + 1),  # pre/post attention and MLP
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", 2 * 6 + 1),  # both, q_norm, k_norm
}


def build(name, dtype=torch.float32):
    config_cls, model_cls, _ = MODELS[name]
    config = getattr(transformers, config_cls)(**SMALL, attn_implementation="eager")
    torch.manual_seed(0)
    model = getattr(transformers, model_cls)(config).to(dtype)
    gen = torch.Generator().manual_seed(1)
    with torch.no_grad():
        # Random norm weights: the models start them at ones (zeros for Gemma's 1 + weight).
        for module in model.modules():
            if type(module).__name__.endswith("RMSNorm"):
                w = module.weight
                w.copy_(torch.randn(w.shape, generator=gen, dtype=torch.float64).mul(0.3).to(dtype))
    return model.train()


def tokens(seed=2, batch=2, length=12):
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, SMALL["vocab_size"], (batch, length), generator=gen)


def logits_and_grads(model):
    model.zero_grad()
    ids = tokens()
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    return out.logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


def norm_modules(model):
    return {n: m for n, m in model.named_modules() if type(m).__name__.endswith("RMSNorm")}


@pytest.mark.parametrize("name", list(MODELS))
def test_float32_model_matches_unpatched(name):
    model = build(name)
    patched = copy.deepcopy(model)
    params_before = dict(patched.named_parameters())
    keys_before = list(patched.state_dict())
    assert rt.patch(patched) == MODELS[name][2]

    assert all(isinstance(m, rt.RMSNorm) for m in norm_modules(patched).values())
    assert list(patched.state_dict()) == keys_before
    params_after = dict(patched.named_parameters())
    assert params_after.keys() == params_before.keys()
    assert all(params_after[k] is params_before[k] for k in params_before)  # same objects

    want_logits, want_grads = logits_and_grads(model)
    got_logits, got_grads = logits_and_grads(patched)

    # The only difference is rstd: ours from an exact sum of squares, rounded once to float32,
    # torch's from a float32 mean (a few ulps, ~1e-7 relative); through two layers and the
    # loss that stays far under 1e-5 of each tensor's largest element.
    def close(got, want, what):
        atol = 1e-5 * want.abs().max().item()
        torch.testing.assert_close(got, want, rtol=1e-5, atol=atol, msg=what)

    close(got_logits, want_logits, "logits")
    assert got_grads.keys() == want_grads.keys()
    for key, want in want_grads.items():
        close(got_grads[key], want, key)


def bf16_ulps(a, b):
    to16 = lambda t: t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)  # noqa: E731
    return oracle.ulp_distance16(to16(a), to16(b))


@pytest.mark.parametrize("name", list(MODELS))
def test_bfloat16_modules_within_one_ulp(name):
    model = build(name, torch.bfloat16)
    seen = {}

    def record(key):
        def hook(module, args, output):
            seen.setdefault(key, []).append((args[0].detach().clone(), output.detach().clone()))

        return hook

    hooks = [m.register_forward_hook(record(k)) for k, m in norm_modules(model).items()]
    with torch.no_grad():
        model(input_ids=tokens())
    for h in hooks:
        h.remove()
    originals = norm_modules(model)
    assert rt.patch(model) == MODELS[name][2] == len(seen)
    swapped = norm_modules(model)
    total = equal = 0
    for key, calls in seen.items():
        assert swapped[key] is not originals[key]
        for x, want in calls:
            with torch.no_grad():
                got = swapped[key](x)
            assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
            d = bf16_ulps(got, want)
            assert d.max() <= 1, f"{key}: {d.max()} ulps"
            total += d.size
            equal += int((d == 0).sum())
    assert equal >= 0.99 * total, f"{equal}/{total} equal"


def conventions_installed():
    found = []
    for (module, cls_name), convention in patching.HF_CONVENTIONS.items():
        try:
            mod = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
        except ImportError:
            continue
        if hasattr(mod, cls_name):
            found.append(pytest.param(getattr(mod, cls_name), convention, id=cls_name))
    return found


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
@pytest.mark.parametrize("cls,convention", conventions_installed())
def test_every_known_class_is_equivalent(cls, convention, dtype):
    """Each class of the table, as the installed transformers defines it, against its swap:
    float32 to float32 rounding, bfloat16 within one ulp (rstd may differ in its last bit)."""
    module = cls(48, eps=1e-5).to(dtype)
    with torch.no_grad():
        module.weight.normal_(0.0, 0.5)
    holder = torch.nn.Sequential(module)
    assert rt.patch(holder) == 1
    swapped = holder[0]
    assert isinstance(swapped, rt.RMSNorm) and swapped.weight is module.weight
    assert (swapped.offset, swapped.cast) == convention[1:]
    x = torch.randn(5, 7, 48, generator=torch.Generator().manual_seed(0)).to(dtype)
    with torch.no_grad():
        want, got = module(x), swapped(x)
    assert got.dtype == want.dtype
    if dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    else:
        assert bf16_ulps(got, want).max() <= 1


def test_llama_convention_with_float32_weights_promotes_like_the_original():
    from transformers.models.llama.modeling_llama import LlamaRMSNorm

    module = LlamaRMSNorm(32)  # float32 weight, bfloat16 activations
    with torch.no_grad():
        module.weight.normal_()
    holder = torch.nn.Sequential(module)
    rt.patch(holder)
    x = torch.randn(4, 32).to(torch.bfloat16)
    with torch.no_grad():
        want, got = module(x), holder[0](x)
    assert got.dtype == want.dtype == torch.float32
    torch.testing.assert_close(got, want, rtol=1e-2, atol=1e-2)
    assert holder[0].variance_epsilon == module.variance_epsilon


def test_torch_rmsnorm_and_unknown_modules():
    class LlamaRMSNorm(torch.nn.Module):  # same name, not transformers': must stay
        def __init__(self):
            super().__init__()
            self.weight = torch.nn.Parameter(torch.ones(8))

        def forward(self, x):
            return x

    shared = torch.nn.RMSNorm(8, eps=None)
    model = torch.nn.Sequential(
        torch.nn.RMSNorm((2, 8), elementwise_affine=False),
        shared,
        torch.nn.LayerNorm(8),
        LlamaRMSNorm(),
        torch.nn.Sequential(shared),
    )
    with torch.no_grad():
        shared.weight.uniform_(0.5, 1.5)
    x = torch.randn(3, 2, 8)
    with torch.no_grad():
        want = model(x)
    keys = list(model.state_dict())
    assert rt.patch(model) == 2
    assert isinstance(model[0], rt.RMSNorm) and model[0].weight is None
    assert model[1] is model[4][0] and model[1].weight is shared.weight
    assert model[1].eps is None
    assert type(model[2]) is torch.nn.LayerNorm and type(model[3]) is LlamaRMSNorm
    assert list(model.state_dict()) == keys
    with torch.no_grad():
        torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-6)
    assert rt.patch(model) == 0  # nothing left to swap
