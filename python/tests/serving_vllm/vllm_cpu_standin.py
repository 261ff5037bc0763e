"""A vLLM general plugin (``vllm.general_plugins`` entry point, registered by the test that
needs it): a no-op ``torch.ops._C.init_cpu_memory_env``, the one compiled op vLLM's CPU worker
calls while it is constructed (NUMA memory binding). vLLM's PyPI wheel is built for CUDA and
has no ``vllm._C``; vLLM loads general plugins in each worker process before it constructs
the worker, so the worker class itself is vLLM's."""


def register():
    import torch

    try:
        torch.ops._C.init_cpu_memory_env
        return
    except AttributeError:
        pass
    global _LIBRARY
    _LIBRARY = torch.library.Library("_C", "FRAGMENT")
    _LIBRARY.define("init_cpu_memory_env(int[] nodes) -> ()")
    _LIBRARY.impl("init_cpu_memory_env", lambda nodes: None, "CompositeExplicitAutograd")
