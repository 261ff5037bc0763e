//! Initiator and target in two processes: the target's descriptor handed over by TCP or the
//! rendezvous, a line protocol to ask for verification, and the initiator's sweep.

use super::*;

pub(crate) fn read_line(reader: &mut impl BufRead) -> Result<String, BoxError> {
    let mut line = String::new();
    if reader.read_line(&mut line)? == 0 {
        return Err("the peer closed the connection".into());
    }
    Ok(line.trim().to_owned())
}

/// How initiator and target talk besides RDMA: lines over a TCP socket (`--addr`), or engine
/// messages between peers found through the rendezvous (`--rendezvous`).
pub(crate) enum Control {
    Tcp {
        reader: BufReader<TcpStream>,
        out: TcpStream,
    },
    Engine {
        engine: Arc<TransferEngine>,
        peer: engine_core::NetAddr,
        lines: std::sync::mpsc::Receiver<String>,
        /// Keeps this side published.
        _published: xfer_rendezvous::Publication,
    },
}

impl Control {
    /// Engine messages into a channel of lines.
    fn listen(engine: &Arc<TransferEngine>) -> Result<std::sync::mpsc::Receiver<String>, BoxError> {
        let (tx, rx) = std::sync::mpsc::channel();
        let tx = std::sync::Mutex::new(tx);
        engine.submit_recvs(256, 8, move |m| {
            let _ = tx
                .lock()
                .unwrap()
                .send(String::from_utf8_lossy(m).into_owned());
        })?;
        Ok(rx)
    }

    fn send(&mut self, line: &str) -> Result<(), BoxError> {
        match self {
            Control::Tcp { out, .. } => Ok(writeln!(out, "{line}")?),
            Control::Engine { engine, peer, .. } => {
                let sent = engine_core::DoneFlag::new();
                engine.submit_send(peer, line.as_bytes(), sent.clone())?;
                Ok(sent.wait(Duration::from_secs(30))?)
            }
        }
    }

    fn recv(&mut self) -> Result<String, BoxError> {
        match self {
            Control::Tcp { reader, .. } => read_line(reader),
            Control::Engine { lines, .. } => Ok(lines.recv_timeout(Duration::from_secs(300))?),
        }
    }
}

/// Target: registers a buffer, hands its descriptor over (TCP or the rendezvous), verifies
/// on request.
pub(crate) fn target(args: &Args, config: &Config) -> Result<(), BoxError> {
    let engine = Arc::new(TransferEngine::open(config)?);
    let span = buffer_span(args, 1)?;
    let dst = HostBuffer::new(&engine, span as usize)?;
    let mut control = match &args.rendezvous {
        Some(url) => {
            let lines = Control::listen(&engine)?;
            let rdv = xfer_rendezvous::Rendezvous::connect_within(
                url,
                xfer_rendezvous::connect_wait(config),
            )?;
            let published = rdv.publish(
                "bench-target",
                &engine.main_address(),
                &[("dst", dst.desc())],
                Duration::from_secs(5),
            )?;
            eprintln!(
                "target: {} NICs on {}, published on {url}",
                engine.nic_count(),
                engine.backend()
            );
            let peer = rdv.lookup("bench-initiator", Duration::from_secs(60))?.addr;
            Control::Engine {
                engine: Arc::clone(&engine),
                peer,
                lines,
                _published: published,
            }
        }
        None => {
            let listener = TcpListener::bind(&args.addr)?;
            eprintln!(
                "target: {} NICs on {}, listening on {}",
                engine.nic_count(),
                engine.backend(),
                args.addr
            );
            let (stream, _) = listener.accept()?;
            let reader = BufReader::new(stream.try_clone()?);
            let mut out = stream;
            writeln!(out, "{}", dst.desc())?;
            Control::Tcp { reader, out }
        }
    };
    loop {
        let line = control.recv()?;
        let words: Vec<&str> = line.split_whitespace().collect();
        match words.as_slice() {
            ["check", bytes, seed] => {
                let (bytes, seed): (usize, u64) = (bytes.parse()?, seed.parse()?);
                let bad = dst.to_vec()[..bytes]
                    .iter()
                    .enumerate()
                    .position(|(i, &x)| x != pattern(seed, i));
                match bad {
                    None => control.send("ok")?,
                    Some(at) => control.send(&format!("bad {at}"))?,
                }
            }
            ["bye"] => return Ok(()),
            _ => return Err(format!("unexpected request {line:?}").into()),
        }
    }
}

/// Initiator: fetches the target's descriptor, runs the sweep, asks the target to verify.
pub(crate) fn initiator(args: &Args, config: &Config) -> Result<Report, BoxError> {
    let engine = Arc::new(TransferEngine::open(config)?);
    let (desc, mut control) = match &args.rendezvous {
        Some(url) => {
            let lines = Control::listen(&engine)?;
            let rdv = xfer_rendezvous::Rendezvous::connect_within(
                url,
                xfer_rendezvous::connect_wait(config),
            )?;
            let published = rdv.publish(
                "bench-initiator",
                &engine.main_address(),
                &[],
                Duration::from_secs(5),
            )?;
            let target = rdv.lookup("bench-target", Duration::from_secs(60))?;
            let desc = target
                .region("dst")
                .ok_or("bench-target published no dst region")?
                .clone();
            let control = Control::Engine {
                engine: Arc::clone(&engine),
                peer: target.addr,
                lines,
                _published: published,
            };
            (desc, control)
        }
        None => {
            let deadline = Instant::now() + Duration::from_secs(30);
            let stream = loop {
                match TcpStream::connect(&args.addr) {
                    Ok(s) => break s,
                    Err(e) if Instant::now() > deadline => {
                        return Err(format!("cannot reach the target at {}: {e}", args.addr).into())
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(100)),
                }
            };
            let mut reader = BufReader::new(stream.try_clone()?);
            let desc: MrDesc = read_line(&mut reader)?.parse()?;
            (
                desc,
                Control::Tcp {
                    reader,
                    out: stream,
                },
            )
        }
    };
    let sizes = sizes(args);
    let span = buffer_span(args, 1)?;
    let src = HostBuffer::new(&engine, span as usize)?;
    let duration = Duration::from_secs_f64(args.duration);
    let mut rows = Vec::new();
    for (k, &block) in sizes.iter().enumerate() {
        let bytes = (block * args.batch_size) as usize;
        let seed = k as u64 + 2;
        let fill: Vec<u8> = (0..bytes).map(|i| pattern(seed, i)).collect();
        src.write(0, &fill)?;
        let (trips, elapsed) = run_trips(
            &engine,
            Op::Write,
            &src,
            &desc,
            block,
            args.batch_size,
            duration,
        )?;
        let mut r = row(block, args.batch_size, trips, elapsed);
        if args.verify {
            control.send(&format!("check {bytes} {seed}"))?;
            r.verified = Some(control.recv()? == "ok");
        }
        rows.push(r);
    }
    control.send("bye")?;
    Ok(Report {
        backend: engine.backend().to_owned(),
        reference: None,
        nics: engine.nic_count(),
        mode: "initiator".into(),
        rows,
        imm_rate: None,
    })
}
