# rmsnorm.torch.patch: which RMSNorm modules of a model can be swapped for rmsnorm.torch.RMSNorm
# without changing the model's results, and the swap itself (same Parameter objects).
"""Swapping torch.nn.RMSNorm and known Hugging Face RMSNorm modules for rmsnorm's."""

import torch

from .torch import RMSNorm, rms_norm

# Hugging Face modules by convention, as (eps attribute, offset, cast):
# * Llama: float32 statistics, x * rstd cast to the input dtype, then `weight * that`.
_LLAMA = ("variance_epsilon", 0.0, "before_weight")
# * Gemma: everything in float32, times (1 + weight), cast to the input dtype at the end.
_GEMMA = ("eps", 1.0, "end")
# * Olmo2: `(weight * x * rstd).to(input dtype)`, the product in float32.
_FLOAT32_PRODUCT = ("variance_epsilon", 0.0, "end")
# (transformers.models.<module>, class name) -> convention; the test checks every entry that
# the installed transformers has against the original module.
HF_CONVENTIONS = {
    **dict.fromkeys(
        [
            ("llama", "LlamaRMSNorm"),
            ("mistral", "MistralRMSNorm"),
            ("ministral", "MinistralRMSNorm"),
            ("mixtral", "MixtralRMSNorm"),
            ("qwen2", "Qwen2RMSNorm"),
            ("qwen2_moe", "Qwen2MoeRMSNorm"),
            ("qwen2_vl", "Qwen2VLRMSNorm"),
            ("qwen2_5_vl", "Qwen2_5_VLRMSNorm"),
            ("qwen3", "Qwen3RMSNorm"),
            ("qwen3_moe", "Qwen3MoeRMSNorm"),
            ("phi3", "Phi3RMSNorm"),
            ("granite", "GraniteRMSNorm"),
            ("granitemoe", "GraniteMoeRMSNorm"),
            ("deepseek_v2", "DeepseekV2RMSNorm"),
            ("deepseek_v3", "DeepseekV3RMSNorm"),
            ("glm", "GlmRMSNorm"),
            ("glm4", "Glm4RMSNorm"),
            ("smollm3", "SmolLM3RMSNorm"),
            ("exaone4", "Exaone4RMSNorm"),
            ("arcee", "ArceeRMSNorm"),
            ("seed_oss", "SeedOssRMSNorm"),
            ("ernie4_5", "Ernie4_5RMSNorm"),
        ],
        _LLAMA,
    ),
    **dict.fromkeys(
        [
            ("gemma", "GemmaRMSNorm"),
            ("gemma2", "Gemma2RMSNorm"),
            ("gemma3", "Gemma3RMSNorm"),
            ("recurrent_gemma", "RecurrentGemmaRMSNorm"),
            ("t5gemma", "T5GemmaRMSNorm"),
            ("vaultgemma", "VaultGemmaRMSNorm"),
            ("qwen3_next", "Qwen3NextRMSNorm"),
        ],
        _GEMMA,
    ),
    **dict.fromkeys(
        [("olmo2", "Olmo2RMSNorm"), ("olmo3", "Olmo3RMSNorm"), ("gpt_oss", "GptOssRMSNorm")],
        _FLOAT32_PRODUCT,
    ),
}


def _hf_key(cls):
    """(module, class name) of a class defined in transformers.models.<module>.modeling_*."""
    parts = cls.__module__.split(".")
    if len(parts) != 4 or parts[:2] != ["transformers", "models"]:
        return None
    return parts[2], cls.__name__


class HFRMSNorm(RMSNorm):
    """:class:`rmsnorm.torch.RMSNorm` standing in for a Hugging Face RMSNorm: also answers to
    the original's eps attribute, and keeps the Llama convention's dtype promotion when the
    weight's dtype differs from the input's (`weight * y` then has the promoted dtype)."""

    def __init__(self, shape, eps, eps_attr, offset, cast, original):
        super().__init__(shape, eps, elementwise_affine=False, offset=offset, cast=cast)
        self.weight = original.weight
        self.elementwise_affine = True
        self._eps_attr = eps_attr
        self._original_class = type(original).__qualname__

    def __getattr__(self, name):
        if name != "_eps_attr" and name == self.__dict__.get("_eps_attr"):
            return self.eps
        return super().__getattr__(name)

    def forward(self, x):
        w = self.weight
        if self.cast == "before_weight" and w is not None and w.dtype != x.dtype:
            return w * rms_norm(x, self.normalized_shape, None, self.eps)
        return super().forward(x)

    def extra_repr(self):
        return f"{super().extra_repr()}, replaces={self._original_class}"


def _replacement(module):
    """The rmsnorm module equivalent to `module`, or None when its convention is unknown."""
    cls = type(module)
    if cls is torch.nn.RMSNorm:
        new = RMSNorm(module.normalized_shape, module.eps, elementwise_affine=False)
        new.elementwise_affine = module.elementwise_affine
        new.weight = module.weight
        return new
    convention = HF_CONVENTIONS.get(_hf_key(cls))
    if convention is None:
        return None
    eps_attr, offset, cast = convention
    weight = getattr(module, "weight", None)
    if not isinstance(weight, torch.nn.Parameter) or weight.dim() != 1:
        return None
    return HFRMSNorm(
        tuple(weight.shape), float(getattr(module, eps_attr)), eps_attr, offset, cast, module
    )


def patch_modules(model):
    """rmsnorm.torch.patch (documented there)."""
    # id(old) -> (old, new): a module shared by several parents stays shared (old is kept
    # alive so that its id is not reused).
    done = {}
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if id(child) not in done:
                new = _replacement(child)
                if new is None:
                    continue
                new.train(child.training)
                done[id(child)] = (child, new)
            setattr(parent, name, done[id(child)][1])
    return len(done)
