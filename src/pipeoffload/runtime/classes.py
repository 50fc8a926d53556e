"""Which tensor class a saved tensor belongs to: the module whose forward saved it.

The offloader moves a (stage, microbatch)'s saved storages of the classes its schedule chose
(core/classes.py) and keeps the rest on the device. A storage's class is read when autograd
first saves it, from the innermost running module whose attribute name ``MODULE_CLASSES``
knows (forward pre- and post-hooks keep the stack); a tensor saved outside all of them (the
embedding, the head, the loss) is ``OTHER``. The names are the reference model's
(training/model.py) and the Hugging Face Llama family's; a module's last name decides.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from torch import nn
from torch.utils.hooks import RemovableHandle

OTHER = "other"

#: A module's attribute name -> the class of what autograd saves while it runs (its own
#: saves, not those of a known submodule). Reference model | Hugging Face Llama.
MODULE_CLASSES: dict[str, str] = {
    "attention_norm": "layer_input", "input_layernorm": "layer_input",
    "wq": "attn_norm", "wk": "attn_norm", "wv": "attn_norm",
    "q_proj": "attn_norm", "k_proj": "attn_norm", "v_proj": "attn_norm",
    "attention": "qkv", "self_attn": "qkv",  # rotary, attention core: Q, K, V and output
    "wo": "attn_out", "o_proj": "attn_out",
    "ffn_norm": "mlp_input", "post_attention_layernorm": "mlp_input",
    "w1": "mlp_norm", "w3": "mlp_norm", "gate_proj": "mlp_norm", "up_proj": "mlp_norm",
    "feed_forward": "mlp_hidden", "mlp": "mlp_hidden", "act_fn": "mlp_hidden",
    "w2": "mlp_act", "down_proj": "mlp_act",
}


class ClassTagger:
    """The class of whatever autograd saves now (``current``), kept by module hooks on the
    modules given to ``attach``."""

    def __init__(self) -> None:
        self._stack: list[str] = []
        self._handles: list[RemovableHandle] = []

    def attach(self, modules: Iterable[nn.Module]) -> None:
        """Hook every submodule whose name ``MODULE_CLASSES`` knows. The hooks are closures
        over this tagger's stack (not bound methods): a deep copy of a hooked module (a
        reference run) then shares the stack with balanced pushes and pops."""
        stack = self._stack

        def enter(tag: str) -> Callable[[nn.Module, object], None]:
            def push(module: nn.Module, args: object) -> None:
                stack.append(tag)
            return push

        def leave(module: nn.Module, args: object, output: object) -> None:
            if stack:
                stack.pop()

        for module in modules:
            for name, sub in module.named_modules():
                tag = MODULE_CLASSES.get(name.rpartition(".")[2])
                if tag is not None:
                    self._handles.append(sub.register_forward_pre_hook(enter(tag)))
                    self._handles.append(sub.register_forward_hook(leave, always_call=True))

    def current(self) -> str:
        """The class of a tensor saved now."""
        return self._stack[-1] if self._stack else OTHER

    def detach(self) -> None:
        """Remove the hooks."""
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
