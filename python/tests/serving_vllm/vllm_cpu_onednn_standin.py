"""A vLLM general plugin (registered by the test that needs it): stand-ins for the three compiled
ops of vLLM's CPU oneDNN GEMM, ``torch.ops._C.create_onednn_mm_handler``, ``onednn_mm`` and
``release_dnnl_matmul_handler``, which vLLM's PyPI wheel (built for CUDA) lacks. With them, vLLM's
own ``dispatch_cpu_unquantized_gemm`` takes the path a CPU build of vLLM takes: at
``process_weights_after_loading`` each linear layer's weight is packed into the handler's own
memory (here a copy, as oneDNN's packed layout is), the layer's ``cpu_linear`` computes from
that copy, and the layer's ``weight`` is released (an empty tensor; the vocabulary embedding
and LM head keep theirs). Hides: oneDNN's real packed layout and numerics (the copy is the
weight as given, the product is torch's)."""

_HANDLES = {}


def register():
    import torch

    try:
        torch.ops._C.create_onednn_mm_handler
        return
    except AttributeError:
        pass
    global _LIBRARY
    _LIBRARY = torch.library.Library("_C", "FRAGMENT")
    _LIBRARY.define("create_onednn_mm_handler(Tensor weight, int primitive_cache_size) -> int")
    _LIBRARY.define("onednn_mm(Tensor(a!) c, Tensor a, Tensor? bias, Tensor handler) -> ()")
    _LIBRARY.define("release_dnnl_matmul_handler(int handler) -> ()")

    def create(weight, primitive_cache_size):  # weight: [K, N]
        handle = max(_HANDLES, default=0) + 1
        _HANDLES[handle] = weight.detach().contiguous().clone()
        return handle

    def mm(c, a, bias, handler):
        out = a @ _HANDLES[int(handler.item())]
        if bias is not None:
            out = out + bias
        c.copy_(out.reshape(c.shape))

    _LIBRARY.impl("create_onednn_mm_handler", create, "CompositeExplicitAutograd")
    _LIBRARY.impl("onednn_mm", mm, "CompositeExplicitAutograd")
    def release(handler):
        _HANDLES.pop(handler, None)

    _LIBRARY.impl("release_dnnl_matmul_handler", release, "CompositeExplicitAutograd")
    import vllm._custom_ops as ops

    ops._supports_onednn = True
