//! GPU memory on soft-RoCE with the fake CUDA driver (run in the rxe guest with the fakes on
//! LD_LIBRARY_PATH; `cargo xtask test` does): the dma-buf export succeeds, soft-RoCE refuses
//! `ibv_reg_dmabuf_mr`, the plain registration of a device pointer fails too (the CPU cannot
//! reach device memory, so neither can the kernel's page pinning), and the engine's error is
//! typed and names both reasons — with the exported fd closed, not leaked.

fn open_fds() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

#[test]
#[ignore = "needs soft-RoCE devices and the GPU fakes: runs in the rxe guest"]
fn gpu_memory_on_soft_roce_is_refused_with_both_reasons() {
    backend_verbs::link();
    let text = "backend = \"verbs\"\n[[groups]]\nnics = [\"rxe0\"]\n";
    let config = engine_core::Config::from_toml(text, std::path::Path::new("<rxe gpu>")).unwrap();
    let engine = engine_core::TransferEngine::open(&config).unwrap();
    let gpu = xfer_cuda::DeviceBuffer::new(0, 64 << 10).expect("the fake CUDA driver");
    let fds = open_fds();
    // SAFETY: refused; nothing stays registered.
    let refused = unsafe {
        engine.reg_mr(
            gpu.ptr() as *mut u8,
            gpu.len(),
            engine_core::Device::Cuda(0),
        )
    };
    match refused {
        Err(engine_core::Error::Refused { source, .. })
            if source.message.contains("cannot be registered with rxe0")
                && source.message.contains("dma-buf:")
                && source.message.contains("nvidia-peermem:") =>
        {
            eprintln!("{source}")
        }
        other => panic!("expected the typed refusal with both reasons, got {other:?}"),
    }
    assert_eq!(open_fds(), fds, "the exported dma-buf fd was closed");
}
