//! The rendezvous connections kept open for the rest of the job, so that a rank that
//! stops is known to every other rank within moments, named, with its reason when it
//! gave one: a collective waiting on a dead peer otherwise learns it only at NCCL's
//! timeout, and then without knowing which rank it was.
//!
//! Rank 0 holds a connection to every other rank; the others one each, to rank 0. A rank
//! that ends its run says goodbye ([`Liveness::leave`]); one that fails says why
//! ([`Liveness::fail`]); one that is killed or crashes closes its connections without a
//! word. Rank 0 relays what it learns about one rank to all the others. Each process
//! reports the first stop it learns of, once, to the callback it gave.
//!
//! Frames after the rendezvous, as its own: a kind byte, a `u32` length, the bytes.
//! `LEFT` (empty): the sender ends normally. `STOPPED`: a `u32` rank and a UTF-8 reason.

use std::fmt;
use std::io::{self, Read};
use std::net::{Shutdown, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};

use crate::rendezvous::send;

const LEFT: u8 = 2;
const STOPPED: u8 = 3;
/// The longest reason a frame carries; a longer one is cut.
const MAX_REASON: usize = 4096;

/// A rank of the job stopped before saying goodbye.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RankStopped {
    /// The rank that stopped.
    pub rank: usize,
    /// Its error, or how its stop was noticed.
    pub reason: String,
}

impl fmt::Display for RankStopped {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "rank {} stopped: {}", self.rank, self.reason)
    }
}

/// What a process does when it learns that a rank stopped.
pub type OnStop = Arc<dyn Fn(RankStopped) + Send + Sync>;

struct Link {
    rank: usize,
    /// Writing halves: (peer rank, stream).
    peers: Vec<(usize, Mutex<TcpStream>)>,
    /// Set once this process leaves or fails: its own readers then end quietly.
    closing: AtomicBool,
    /// Set once a stop was reported: only the first is.
    reported: AtomicBool,
    on_stop: OnStop,
}

impl Link {
    fn report(&self, stopped: RankStopped) {
        if !self.closing.load(Ordering::SeqCst) && !self.reported.swap(true, Ordering::SeqCst) {
            (self.on_stop)(stopped);
        }
    }

    /// Sends `kind` with `bytes` to every peer but `except`; a peer already gone is
    /// skipped.
    fn tell(&self, kind: u8, bytes: &[u8], except: &[usize]) {
        for (peer, stream) in &self.peers {
            if !except.contains(peer) {
                let stream = stream.lock().unwrap_or_else(|e| e.into_inner());
                let _ = send(&stream, kind, bytes);
            }
        }
    }

    fn close(&self) {
        self.closing.store(true, Ordering::SeqCst);
        for (_, stream) in &self.peers {
            let stream = stream.lock().unwrap_or_else(|e| e.into_inner());
            let _ = stream.shutdown(Shutdown::Both);
        }
    }
}

/// This process's end of the job's liveness connections (module docs). Dropping it
/// without [`Liveness::leave`] or [`Liveness::fail`] closes the connections without a
/// word: the other ranks then report this one as stopped.
pub struct Liveness {
    link: Arc<Link>,
    readers: Vec<JoinHandle<()>>,
}

impl Liveness {
    /// A world of one: nobody to watch.
    pub(crate) fn alone(rank: usize, on_stop: OnStop) -> Self {
        Self::new(rank, Vec::new(), on_stop)
    }

    /// Watches `peers` ((rank, connection), rank 0's connections on rank 0, the one to
    /// rank 0 elsewhere), reporting to `on_stop`.
    pub(crate) fn new(rank: usize, peers: Vec<(usize, TcpStream)>, on_stop: OnStop) -> Self {
        let mut readers = Vec::new();
        let mut writers = Vec::new();
        for (peer, stream) in peers {
            match stream.try_clone() {
                Ok(reader) => {
                    readers.push((peer, reader));
                    writers.push((peer, Mutex::new(stream)));
                }
                // A connection that cannot be read is one that broke.
                Err(e) => on_stop(RankStopped {
                    rank: peer,
                    reason: format!("its connection to rank {rank} failed: {e}"),
                }),
            }
        }
        let link = Arc::new(Link {
            rank,
            peers: writers,
            closing: AtomicBool::new(false),
            reported: AtomicBool::new(false),
            on_stop,
        });
        let readers = readers
            .into_iter()
            .map(|(peer, stream)| {
                let link = Arc::clone(&link);
                thread::Builder::new()
                    .name(format!("floe-liveness-{peer}"))
                    .spawn(move || watch(&link, peer, stream))
                    .expect("a thread for a liveness connection")
            })
            .collect();
        Self { link, readers }
    }

    /// Ends this process's part normally: the others stop watching it.
    pub fn leave(mut self) {
        self.link.tell(LEFT, &[], &[]);
        self.shut();
    }

    /// Tells the others that this rank stops because of `reason` (its error).
    pub fn fail(mut self, reason: &str) {
        self.link.reported.store(true, Ordering::SeqCst);
        let frame = stopped_frame(self.link.rank, reason);
        self.link.tell(STOPPED, &frame, &[]);
        self.shut();
    }

    fn shut(&mut self) {
        self.link.close();
        for reader in self.readers.drain(..) {
            let _ = reader.join();
        }
    }
}

impl Drop for Liveness {
    fn drop(&mut self) {
        self.shut();
    }
}

fn stopped_frame(rank: usize, reason: &str) -> Vec<u8> {
    let mut end = reason.len().min(MAX_REASON);
    while !reason.is_char_boundary(end) {
        end -= 1;
    }
    let mut frame = (rank as u32).to_le_bytes().to_vec();
    frame.extend_from_slice(&reason.as_bytes()[..end]);
    frame
}

/// Reads `peer`'s frames until it leaves, reports a stop, or its connection closes.
fn watch(link: &Link, peer: usize, mut stream: TcpStream) {
    let stopped = match read_frame(&mut stream) {
        Ok((LEFT, _)) => return,
        Ok((STOPPED, bytes)) if bytes.len() >= 4 => RankStopped {
            rank: u32::from_le_bytes(bytes[..4].try_into().expect("4 bytes")) as usize,
            reason: String::from_utf8_lossy(&bytes[4..]).into_owned(),
        },
        Ok((kind, _)) => RankStopped {
            rank: peer,
            reason: format!("it sent frame kind {kind}, not a floe liveness message"),
        },
        Err(_) => RankStopped {
            rank: peer,
            reason: format!(
                "its connection to rank {} closed without a goodbye: the process was killed \
                 or crashed",
                link.rank
            ),
        },
    };
    if link.closing.load(Ordering::SeqCst) {
        return;
    }
    if link.rank == 0 {
        // The others hear it from rank 0, the one connected to everyone.
        let frame = stopped_frame(stopped.rank, &stopped.reason);
        link.tell(STOPPED, &frame, &[peer, stopped.rank]);
    }
    link.report(stopped);
}

fn read_frame(stream: &mut TcpStream) -> io::Result<(u8, Vec<u8>)> {
    let mut header = [0u8; 5];
    stream.read_exact(&mut header)?;
    let len = u32::from_le_bytes(header[1..5].try_into().expect("4 bytes")) as usize;
    if len > MAX_REASON + 4 {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("a liveness frame of {len} bytes"),
        ));
    }
    let mut bytes = vec![0u8; len];
    stream.read_exact(&mut bytes)?;
    Ok((header[0], bytes))
}
