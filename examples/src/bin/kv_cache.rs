//! KV-cache transfer, prefill to decode, layer by layer.
//!
//! The prefill engine "computes" layers in an arbitrary order and, as each finishes, writes its
//! KV pages into the decode engine's page table with one paged write whose immediate is the
//! layer number. The decoder waits on `expect_imm_count(layer, n)` per layer, with `n` from
//! `expected_arrivals`, so it can start attending to layer k as soon as its pages are in,
//! whatever order layers arrive in. Finally every page is checked byte for byte.
//!
//! `--role decode|prefill --rendezvous URL [--config FILE]`: the two sides as separate
//! processes (or machines) that find each other by name: the decoder publishes `decode-0`
//! with its `kv-cache` region on the rendezvous (`xfer serve`, or etcd), the prefill process
//! looks it up and writes; each layer's write also carries a notification, and the decoder
//! checks each layer's bytes the moment its notification arrives. Both sides derive the
//! decoder's scattered page table from the same seed (in a server it would travel with the
//! request).
//!
//! `--pull`: the decoder pulls instead (NIXL's and DLSlime's way): the prefill cache is
//! registered readable, and as each layer is ready the decoder reads its pages into its own
//! scattered pages with one paged RDMA READ; the read's completion says the bytes are there.
#![deny(unsafe_code)]

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use engine_core::{
    expected_arrivals, Device, DoneCounter, HostBuffer, MrDesc, MrHandle, OnDone, Pages,
    RemoteAccess, TransferEngine, TransferShape,
};
use examples::{byte, fail, open_engines};
use xfer_cuda::DeviceBuffer;

const LAYERS: usize = 12;
const PAGES_PER_LAYER: usize = 32;
const PAGE_LEN: u64 = 16 * 1024; // e.g. 16 tokens x 8 heads x 128 dims x bf16 (K and V)

/// A KV cache in host memory, or (`--gpu`) in GPU 0's memory.
enum Cache {
    Host(HostBuffer),
    Gpu {
        memory: DeviceBuffer,
        mr: MrHandle,
        desc: MrDesc,
        engine: Arc<TransferEngine>,
    },
}

impl Cache {
    fn new(engine: &Arc<TransferEngine>, len: usize, gpu: bool, access: RemoteAccess) -> Cache {
        if !gpu {
            return Cache::Host(
                HostBuffer::with_access(engine, len, |_| 0, access).unwrap_or_else(|e| fail(e)),
            );
        }
        let memory = DeviceBuffer::new(0, len).unwrap_or_else(|e| fail(e));
        // SAFETY: `memory` stays allocated until the Cache drops, after deregistration.
        #[allow(unsafe_code)]
        let (mr, desc) =
            unsafe { engine.reg_mr_with(memory.ptr() as *mut u8, len, Device::Cuda(0), access) }
                .unwrap_or_else(|e| fail(e));
        Cache::Gpu {
            memory,
            mr,
            desc,
            engine: Arc::clone(engine),
        }
    }

    fn mr(&self) -> MrHandle {
        match self {
            Cache::Host(b) => b.mr(),
            Cache::Gpu { mr, .. } => *mr,
        }
    }

    fn desc(&self) -> &MrDesc {
        match self {
            Cache::Host(b) => b.desc(),
            Cache::Gpu { desc, .. } => desc,
        }
    }

    fn write(&mut self, at: usize, bytes: &[u8]) {
        match self {
            Cache::Host(b) => b.write(at, bytes).unwrap_or_else(|e| fail(e)),
            Cache::Gpu { memory, .. } => memory.upload(at, bytes).unwrap_or_else(|e| fail(e)),
        }
    }

    fn read(&self) -> Vec<u8> {
        match self {
            Cache::Host(b) => b.to_vec(),
            Cache::Gpu { memory, .. } => memory.download().unwrap_or_else(|e| fail(e)),
        }
    }
}

impl Drop for Cache {
    fn drop(&mut self) {
        if let Cache::Gpu { mr, engine, .. } = self {
            let _ = engine.dereg_mr(*mr);
        }
    }
}

/// The value following `--flag`, if given.
fn arg(flag: &str) -> Option<String> {
    let args: Vec<String> = std::env::args().collect();
    args.iter()
        .position(|a| a == flag)
        .and_then(|i| args.get(i + 1).cloned())
}

/// The decoder's page table: the same scattered slots on both sides (seeded).
fn page_table() -> Vec<Vec<u32>> {
    let slots = LAYERS * PAGES_PER_LAYER;
    let mut rng = fastrand::Rng::with_seed(1);
    let mut free: Vec<u32> = (0..2 * slots as u32).collect();
    rng.shuffle(&mut free);
    (0..LAYERS)
        .map(|l| free[l * PAGES_PER_LAYER..(l + 1) * PAGES_PER_LAYER].to_vec())
        .collect()
}

/// One side of the transfer as its own process (`--role`), meeting the other through the
/// rendezvous.
fn role(role: &str, url: Option<&str>) {
    examples::init_logging();
    let config = engine_core::Config::load(arg("--config").as_deref().map(std::path::Path::new))
        .unwrap_or_else(|e| fail(e));
    let engine = Arc::new(TransferEngine::open(&config).unwrap_or_else(|e| fail(e)));
    // `--rendezvous URL`, else the config's `[rendezvous] url`.
    let (rdv, ttl) = match url {
        Some(url) => (
            xfer_rendezvous::Rendezvous::connect_within(
                url,
                xfer_rendezvous::connect_wait(&config),
            )
            .unwrap_or_else(|e| fail(e)),
            Duration::from_secs(5),
        ),
        None => xfer_rendezvous::Rendezvous::from_config(&config).unwrap_or_else(|e| fail(e)),
    };
    let slots = LAYERS * PAGES_PER_LAYER;
    let table = page_table();
    let wait = Duration::from_secs(60);
    match role {
        "decode" => {
            let cache = Cache::new(
                &engine,
                2 * slots * PAGE_LEN as usize,
                false,
                RemoteAccess::WRITE,
            );
            engine
                .listen_notifications(LAYERS)
                .unwrap_or_else(|e| fail(e));
            let _published = rdv
                .publish(
                    "decode-0",
                    &engine.main_address(),
                    &[("kv-cache", cache.desc())],
                    ttl,
                )
                .unwrap_or_else(|e| fail(e));
            let mut seen = Vec::new();
            while seen.len() < LAYERS {
                let id = engine
                    .wait_notification(wait)
                    .unwrap_or_else(|e| fail(e))
                    .id;
                let layer: usize = std::str::from_utf8(&id)
                    .ok()
                    .and_then(|t| t.strip_prefix("layer-"))
                    .and_then(|n| n.parse().ok())
                    .unwrap_or_else(|| fail(format!("unexpected notification {id:?}")));
                // The notification follows its layer's bytes: check them now.
                let received = cache.read();
                for (p, &page) in table[layer].iter().enumerate() {
                    let at = page as usize * PAGE_LEN as usize;
                    if received[at..at + PAGE_LEN as usize]
                        .iter()
                        .enumerate()
                        .any(|(i, &x)| x != byte(layer, p, i))
                    {
                        fail(format!(
                            "layer {layer} page {p} differs when its notification arrived"
                        ));
                    }
                }
                seen.push(layer);
            }
            println!("decode: {LAYERS} layers verified as their notifications arrived, in order {seen:?}");
        }
        "prefill" => {
            let peer = rdv.lookup("decode-0", wait).unwrap_or_else(|e| fail(e));
            let dst = peer
                .region("kv-cache")
                .unwrap_or_else(|| fail("decode-0 published no kv-cache region"))
                .clone();
            let mut src = Cache::new(
                &engine,
                slots * PAGE_LEN as usize,
                false,
                RemoteAccess::WRITE,
            );
            let sent = DoneCounter::new();
            for (layer, slots) in table.iter().enumerate() {
                let src_pages = compute_layer(&mut src, layer);
                let dst_layer = Pages {
                    indices: slots.clone(),
                    stride: PAGE_LEN,
                    offset: 0,
                };
                let done = engine
                    .notify_when_done(
                        dst.owner(),
                        format!("layer-{layer}").as_bytes(),
                        sent.clone(),
                    )
                    .unwrap_or_else(|e| fail(e));
                engine
                    .submit_paged_writes(
                        PAGE_LEN,
                        Some(layer as u32),
                        (src.mr(), &src_pages),
                        (&dst, &dst_layer),
                        done,
                    )
                    .unwrap_or_else(|e| fail(e));
            }
            sent.wait_for(LAYERS as u64, wait)
                .unwrap_or_else(|e| fail(e));
            println!(
                "prefill: {LAYERS} layers sent to {} (incarnation {:016x}) over {}",
                peer.name,
                peer.incarnation,
                engine.backend()
            );
        }
        other => fail(format!("--role {other}: expected decode or prefill")),
    }
}

fn main() {
    if let Some(r) = arg("--role") {
        return role(&r, arg("--rendezvous").as_deref());
    }
    let gpu = std::env::args().any(|a| a == "--gpu");
    if std::env::args().any(|a| a == "--pull") {
        return pull(gpu);
    }
    let engines = open_engines(2, 2).unwrap_or_else(|e| fail(e));
    let (prefill, decode) = (&engines[0], &engines[1]);
    let slots = LAYERS * PAGES_PER_LAYER;
    let mut src = Cache::new(prefill, slots * PAGE_LEN as usize, gpu, RemoteAccess::WRITE);
    // The decoder's cache is bigger and its page allocator hands out scattered pages.
    let dst = Cache::new(
        decode,
        2 * slots * PAGE_LEN as usize,
        gpu,
        RemoteAccess::WRITE,
    );
    let mut rng = fastrand::Rng::with_seed(1);
    let mut free: Vec<u32> = (0..2 * slots as u32).collect();
    rng.shuffle(&mut free);
    let dst_pages: Vec<Vec<u32>> = (0..LAYERS)
        .map(|l| free[l * PAGES_PER_LAYER..(l + 1) * PAGES_PER_LAYER].to_vec())
        .collect();

    // Decoder: one expectation per layer, registered before anything is sent.
    let stripe = &decode.config().stripe;
    let per_layer = expected_arrivals(
        TransferShape::Paged {
            page_len: PAGE_LEN,
            pages: PAGES_PER_LAYER as u64,
        },
        decode.nic_count(),
        stripe,
    );
    let arrived = Arc::new(Mutex::new(Vec::new()));
    let remaining = Arc::new(AtomicUsize::new(LAYERS));
    for layer in 0..LAYERS {
        let (arrived, remaining) = (Arc::clone(&arrived), Arc::clone(&remaining));
        decode
            .expect_imm_count(
                layer as u32,
                per_layer,
                OnDone::callback(move |r| {
                    r.unwrap_or_else(|e| fail(format!("layer {layer}: {e}")));
                    arrived.lock().unwrap().push(layer);
                    remaining.fetch_sub(1, Ordering::SeqCst);
                }),
            )
            .unwrap_or_else(|e| fail(e));
    }

    // Prefill: layers finish in any order; each layer's pages go out as soon as it is done.
    let mut order: Vec<usize> = (0..LAYERS).collect();
    rng.shuffle(&mut order);
    let sent = DoneCounter::new();
    for &layer in &order {
        let src_pages = compute_layer(&mut src, layer);
        let dst_layer = Pages {
            indices: dst_pages[layer].clone(),
            stride: PAGE_LEN,
            offset: 0,
        };
        prefill
            .submit_paged_writes(
                PAGE_LEN,
                Some(layer as u32),
                (src.mr(), &src_pages),
                (dst.desc(), &dst_layer),
                sent.clone(),
            )
            .unwrap_or_else(|e| fail(e));
    }
    sent.wait_for(LAYERS as u64, Duration::from_secs(30))
        .unwrap_or_else(|e| fail(e));
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    while remaining.load(Ordering::SeqCst) > 0 {
        if std::time::Instant::now() > deadline {
            fail("the decoder did not see every layer");
        }
        std::thread::sleep(Duration::from_millis(1));
    }

    let received = dst.read();
    for (layer, pages) in dst_pages.iter().enumerate() {
        for (p, &page) in pages.iter().enumerate() {
            let at = page as usize * PAGE_LEN as usize;
            let got = &received[at..at + PAGE_LEN as usize];
            if got.iter().enumerate().any(|(i, &x)| x != byte(layer, p, i)) {
                fail(format!("layer {layer} page {p} differs"));
            }
        }
    }
    println!(
        "kv-cache ({} memory): {LAYERS} layers x {PAGES_PER_LAYER} pages of {PAGE_LEN} B over {} NICs; sent in order {order:?}, decoder saw {:?}; all bytes verified",
        if gpu { "GPU" } else { "host" },
        prefill.nic_count(),
        arrived.lock().unwrap()
    );
}

/// "Computes" a layer into the prefill cache (its pages are the layer's slots) and returns
/// them.
fn compute_layer(src: &mut Cache, layer: usize) -> Pages {
    let first = layer * PAGES_PER_LAYER;
    for p in 0..PAGES_PER_LAYER {
        let page: Vec<u8> = (0..PAGE_LEN as usize).map(|i| byte(layer, p, i)).collect();
        src.write((first + p) * PAGE_LEN as usize, &page);
    }
    Pages {
        indices: (first as u32..(first + PAGES_PER_LAYER) as u32).collect(),
        stride: PAGE_LEN,
        offset: 0,
    }
}

/// `--pull`: the decoder reads each layer's pages from the prefill cache as the layer is ready.
fn pull(gpu: bool) {
    let engines = open_engines(2, 2).unwrap_or_else(|e| fail(e));
    let (prefill, decode) = (&engines[0], &engines[1]);
    let slots = LAYERS * PAGES_PER_LAYER;
    let mut src = Cache::new(prefill, slots * PAGE_LEN as usize, gpu, RemoteAccess::READ);
    let dst = Cache::new(
        decode,
        2 * slots * PAGE_LEN as usize,
        gpu,
        RemoteAccess::WRITE,
    );
    let mut rng = fastrand::Rng::with_seed(2);
    let mut free: Vec<u32> = (0..2 * slots as u32).collect();
    rng.shuffle(&mut free);
    let mut order: Vec<usize> = (0..LAYERS).collect();
    rng.shuffle(&mut order);
    let pulled = DoneCounter::new();
    for &layer in &order {
        // Prefill computes the layer; the decoder is told (in a real system: a notification
        // or a watcher slot) and pulls its pages into free slots of its own cache.
        let first = layer * PAGES_PER_LAYER;
        let remote = compute_layer(&mut src, layer);
        let local = Pages {
            indices: free[first..first + PAGES_PER_LAYER].to_vec(),
            stride: PAGE_LEN,
            offset: 0,
        };
        decode
            .submit_paged_reads(
                PAGE_LEN,
                (dst.mr(), &local),
                (src.desc(), &remote),
                pulled.clone(),
            )
            .unwrap_or_else(|e| fail(e));
    }
    pulled
        .wait_for(LAYERS as u64, Duration::from_secs(30))
        .unwrap_or_else(|e| fail(e));
    let received = dst.read();
    for layer in 0..LAYERS {
        for p in 0..PAGES_PER_LAYER {
            let at = free[layer * PAGES_PER_LAYER + p] as usize * PAGE_LEN as usize;
            let got = &received[at..at + PAGE_LEN as usize];
            if got.iter().enumerate().any(|(i, &x)| x != byte(layer, p, i)) {
                fail(format!("pulled layer {layer} page {p} differs"));
            }
        }
    }
    println!(
        "kv-cache pull ({} memory): the decoder read {LAYERS} layers x {PAGES_PER_LAYER} pages of {PAGE_LEN} B over {} NICs in order {order:?}; all bytes verified",
        if gpu { "GPU" } else { "host" },
        decode.nic_count()
    );
}
