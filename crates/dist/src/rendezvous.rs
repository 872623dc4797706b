//! Rank 0 hands every other rank a blob (NCCL's unique id) over TCP.
//!
//! Wire format, little-endian: a joining rank sends `MAGIC`, its rank and the world size
//! it was started with (`u32` each); once every rank has joined, rank 0 answers each with
//! a status byte (0: the blob follows, 1: a UTF-8 error message follows), a `u32` length
//! and the bytes.

use std::io::{self, Read, Write};
use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, TcpListener, TcpStream};
use std::thread;
use std::time::{Duration, Instant};

use crate::liveness::{Liveness, OnStop};
use crate::World;

const MAGIC: &[u8; 8] = b"FLOERDV1";
const STATUS_BLOB: u8 = 0;
const STATUS_FAILED: u8 = 1;
/// How often a waiting rank retries: rank 0 may start after the others.
const POLL: Duration = Duration::from_millis(20);
/// How long rank 0 waits for a new connection's greeting: a floe rank sends it at once;
/// anything slower is not a floe rank and is dropped.
const GREETING_TIMEOUT: Duration = Duration::from_secs(5);
/// The largest blob a joining rank accepts (an NCCL id is 128 bytes).
const MAX_BLOB: u32 = 1 << 20;

/// Why a rendezvous failed; each names the address and the ranks concerned.
#[derive(Debug, thiserror::Error)]
pub enum RendezvousError {
    /// Rank 0 could not listen on the master address.
    #[error("rank 0 cannot listen on {addr} (MASTER_ADDR:MASTER_PORT): {source}")]
    Bind {
        /// The address.
        addr: SocketAddr,
        /// Why.
        source: io::Error,
    },
    /// Ranks did not join before the timeout.
    #[error(
        "rendezvous on {addr} timed out after {waited:?}: rank(s) {} of world size {world_size} never joined",
        list(missing)
    )]
    Timeout {
        /// Rank 0's address.
        addr: SocketAddr,
        /// The ranks that never joined, ascending.
        missing: Vec<usize>,
        /// The world size.
        world_size: usize,
        /// How long rank 0 waited.
        waited: Duration,
    },
    /// A joining process disagrees with rank 0 about the world.
    #[error("rendezvous on {addr}: {problem}")]
    Mismatch {
        /// Rank 0's address.
        addr: SocketAddr,
        /// The rank and values at fault.
        problem: String,
    },
    /// A joining rank could not reach rank 0 before the timeout.
    #[error("rank {rank} could not reach rank 0 at {addr} within {waited:?}: {source}")]
    Unreachable {
        /// The joining rank.
        rank: usize,
        /// Rank 0's address.
        addr: SocketAddr,
        /// How long it tried.
        waited: Duration,
        /// The last connection error.
        source: io::Error,
    },
    /// Rank 0 reported a failure to this rank (e.g. others never joined).
    #[error("rank {rank}: the rendezvous at rank 0 ({addr}) failed: {message}")]
    FailedAtMaster {
        /// The joining rank.
        rank: usize,
        /// Rank 0's address.
        addr: SocketAddr,
        /// Rank 0's error.
        message: String,
    },
    /// A connection broke or carried something unexpected.
    #[error("rank {rank}: rendezvous with {addr}: {source}")]
    Io {
        /// The rank that saw it.
        rank: usize,
        /// The peer's address.
        addr: SocketAddr,
        /// What happened.
        source: io::Error,
    },
}

fn list(ranks: &[usize]) -> String {
    ranks
        .iter()
        .map(usize::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The blob every rank of `world` ends up with: rank 0 makes it with `make` and hands it
/// out; the others receive it. Fails after `timeout` naming the ranks that did not come.
/// A world of one process opens no socket.
pub fn rendezvous(
    world: &World,
    make: impl FnOnce() -> Vec<u8>,
    timeout: Duration,
) -> Result<Vec<u8>, RendezvousError> {
    if world.world_size == 1 {
        return Ok(make());
    }
    if world.is_master() {
        let master = Master::bind(world)?;
        let blob = make();
        master.serve(&blob, timeout)?;
        Ok(blob)
    } else {
        join(world, timeout)
    }
}

/// [`rendezvous`], keeping the connections open as the job's [`Liveness`] links: from
/// then on `on_stop` hears, once, of the first rank that stops without saying goodbye.
pub fn rendezvous_linked(
    world: &World,
    make: impl FnOnce() -> Vec<u8>,
    timeout: Duration,
    on_stop: OnStop,
) -> Result<(Vec<u8>, Liveness), RendezvousError> {
    if world.world_size == 1 {
        return Ok((make(), Liveness::alone(world.rank, on_stop)));
    }
    let linked = |rank: usize, addr: SocketAddr, stream: TcpStream| {
        stream
            .set_read_timeout(None)
            .map(|()| (rank, stream))
            .map_err(|source| RendezvousError::Io {
                rank: world.rank,
                addr,
                source,
            })
    };
    if world.is_master() {
        let master = Master::bind(world)?;
        let blob = make();
        let joined = master.serve_streams(&blob, timeout)?;
        let peers = joined
            .into_iter()
            .map(|(rank, stream, addr)| linked(rank, addr, stream))
            .collect::<Result<_, _>>()?;
        Ok((blob, Liveness::new(0, peers, on_stop)))
    } else {
        let (blob, stream) = join_stream(world, timeout)?;
        let peer = linked(0, world.master, stream)?;
        Ok((blob, Liveness::new(world.rank, vec![peer], on_stop)))
    }
}

/// Rank 0's listening side of a rendezvous.
pub struct Master {
    listener: TcpListener,
    world_size: usize,
    addr: SocketAddr,
}

impl Master {
    /// Listens on `world.master`'s port: on loopback when the master address is loopback
    /// (tests, one node), else on every interface, since the name other nodes use for
    /// this host may resolve to another interface here.
    pub fn bind(world: &World) -> Result<Self, RendezvousError> {
        let ip = world.master.ip();
        let bind_ip = match (ip.is_loopback(), ip) {
            (true, _) => ip,
            (false, IpAddr::V4(_)) => IpAddr::V4(Ipv4Addr::UNSPECIFIED),
            (false, IpAddr::V6(_)) => IpAddr::V6(Ipv6Addr::UNSPECIFIED),
        };
        let bind = SocketAddr::new(bind_ip, world.master.port());
        let fail = |source| RendezvousError::Bind { addr: bind, source };
        let listener = TcpListener::bind(bind).map_err(fail)?;
        let addr = listener.local_addr().map_err(fail)?;
        listener.set_nonblocking(true).map_err(fail)?;
        Ok(Self {
            listener,
            world_size: world.world_size,
            addr,
        })
    }

    /// The address it listens on (its port is the chosen one when bound to port 0).
    pub fn addr(&self) -> SocketAddr {
        self.addr
    }

    /// Waits until every other rank has joined, then sends each `blob`. Returns each
    /// rank's address as rank 0 saw it (rank 0's own is the listening address). On
    /// failure the ranks that joined are told why before this returns the error.
    pub fn serve(
        &self,
        blob: &[u8],
        timeout: Duration,
    ) -> Result<Vec<SocketAddr>, RendezvousError> {
        let joined = self.serve_streams(blob, timeout)?;
        Ok(std::iter::once(self.addr)
            .chain(joined.into_iter().map(|(_, _, addr)| addr))
            .collect())
    }

    /// [`Master::serve`], returning each other rank's connection: `(rank, stream,
    /// address)` in rank order.
    fn serve_streams(
        &self,
        blob: &[u8],
        timeout: Duration,
    ) -> Result<Vec<(usize, TcpStream, SocketAddr)>, RendezvousError> {
        let start = Instant::now();
        let mut joined: Vec<Option<(TcpStream, SocketAddr)>> =
            (0..self.world_size).map(|_| None).collect();
        let mut waiting = self.world_size - 1;
        while waiting > 0 {
            let (stream, peer) = match self.listener.accept() {
                Ok(conn) => conn,
                Err(e) if e.kind() == io::ErrorKind::WouldBlock => {
                    if start.elapsed() >= timeout {
                        let missing = (1..self.world_size)
                            .filter(|&r| joined[r].is_none())
                            .collect();
                        let error = RendezvousError::Timeout {
                            addr: self.addr,
                            missing,
                            world_size: self.world_size,
                            waited: start.elapsed(),
                        };
                        tell_failure(&mut joined, &error);
                        return Err(error);
                    }
                    thread::sleep(POLL);
                    continue;
                }
                Err(source) => {
                    return Err(RendezvousError::Io {
                        rank: 0,
                        addr: self.addr,
                        source,
                    })
                }
            };
            // Not a floe rank, or one that broke off: it does not count as joined.
            let Ok((rank, world_size)) = read_greeting(&stream) else {
                continue;
            };
            let problem = if world_size != self.world_size {
                Some(format!(
                    "rank {rank} at {peer} was started with world size {world_size}, rank 0 with {}",
                    self.world_size
                ))
            } else if rank == 0 || rank >= self.world_size {
                Some(format!(
                    "a process at {peer} says it is rank {rank}, not one of 1 .. {}",
                    self.world_size
                ))
            } else if let Some((_, first)) = &joined[rank] {
                Some(format!(
                    "rank {rank} joined twice, from {first} and from {peer}"
                ))
            } else {
                None
            };
            if let Some(problem) = problem {
                let error = RendezvousError::Mismatch {
                    addr: self.addr,
                    problem,
                };
                let _ = send(&stream, STATUS_FAILED, error.to_string().as_bytes());
                tell_failure(&mut joined, &error);
                return Err(error);
            }
            joined[rank] = Some((stream, peer));
            waiting -= 1;
        }
        let mut streams = Vec::with_capacity(self.world_size - 1);
        for (rank, slot) in joined.into_iter().enumerate().skip(1) {
            let (stream, peer) = slot.expect("every rank joined");
            send(&stream, STATUS_BLOB, blob).map_err(|source| RendezvousError::Io {
                rank,
                addr: peer,
                source,
            })?;
            streams.push((rank, stream, peer));
        }
        Ok(streams)
    }
}

/// Tells every joined rank why the rendezvous failed; a rank already gone is skipped.
fn tell_failure(joined: &mut [Option<(TcpStream, SocketAddr)>], error: &RendezvousError) {
    let message = error.to_string();
    for (stream, _) in joined.iter_mut().flatten() {
        let _ = send(stream, STATUS_FAILED, message.as_bytes());
    }
}

fn read_greeting(mut stream: &TcpStream) -> io::Result<(usize, usize)> {
    stream.set_nonblocking(false)?;
    stream.set_read_timeout(Some(GREETING_TIMEOUT))?;
    let mut greeting = [0u8; 16];
    stream.read_exact(&mut greeting)?;
    if &greeting[..8] != MAGIC {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "not a floe rank",
        ));
    }
    let rank = u32::from_le_bytes(greeting[8..12].try_into().expect("4 bytes"));
    let world_size = u32::from_le_bytes(greeting[12..16].try_into().expect("4 bytes"));
    Ok((rank as usize, world_size as usize))
}

/// Writes one frame: `status`, the `u32` length of `bytes`, the bytes.
pub(crate) fn send(mut stream: &TcpStream, status: u8, bytes: &[u8]) -> io::Result<()> {
    let len = u32::try_from(bytes.len())
        .map_err(|_| io::Error::new(io::ErrorKind::InvalidInput, "blob over 4 GiB"))?;
    let mut message = Vec::with_capacity(5 + bytes.len());
    message.push(status);
    message.extend_from_slice(&len.to_le_bytes());
    message.extend_from_slice(bytes);
    stream.write_all(&message)?;
    stream.flush()
}

/// A rank other than 0 joins the rendezvous at `world.master` and returns rank 0's blob.
/// It retries until rank 0 listens, then waits for every other rank to have joined, for
/// `timeout` in all.
pub fn join(world: &World, timeout: Duration) -> Result<Vec<u8>, RendezvousError> {
    Ok(join_stream(world, timeout)?.0)
}

/// [`join`], returning the connection to rank 0 too.
fn join_stream(world: &World, timeout: Duration) -> Result<(Vec<u8>, TcpStream), RendezvousError> {
    let start = Instant::now();
    let addr = world.master;
    let rank = world.rank;
    let io_error = |source| RendezvousError::Io { rank, addr, source };
    let mut stream = loop {
        let left = timeout.saturating_sub(start.elapsed());
        match TcpStream::connect_timeout(&addr, left.max(POLL)) {
            Ok(stream) => break stream,
            Err(source) if start.elapsed() >= timeout => {
                return Err(RendezvousError::Unreachable {
                    rank,
                    addr,
                    waited: start.elapsed(),
                    source,
                })
            }
            Err(_) => thread::sleep(POLL),
        }
    };
    let mut greeting = Vec::with_capacity(16);
    greeting.extend_from_slice(MAGIC);
    greeting.extend_from_slice(&(world.rank as u32).to_le_bytes());
    greeting.extend_from_slice(&(world.world_size as u32).to_le_bytes());
    stream.write_all(&greeting).map_err(io_error)?;
    // Rank 0 reports its own timeout when it passes; wait a little longer than that so
    // its message, naming the missing ranks, arrives here.
    let left = timeout.saturating_sub(start.elapsed()) + GREETING_TIMEOUT;
    stream.set_read_timeout(Some(left)).map_err(io_error)?;
    let mut header = [0u8; 5];
    stream.read_exact(&mut header).map_err(io_error)?;
    let len = u32::from_le_bytes(header[1..5].try_into().expect("4 bytes"));
    if len > MAX_BLOB {
        return Err(io_error(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("rank 0 announced {len} bytes, more than a rendezvous carries ({MAX_BLOB})"),
        )));
    }
    let mut bytes = vec![0u8; len as usize];
    stream.read_exact(&mut bytes).map_err(io_error)?;
    match header[0] {
        STATUS_BLOB => Ok((bytes, stream)),
        STATUS_FAILED => Err(RendezvousError::FailedAtMaster {
            rank,
            addr,
            message: String::from_utf8_lossy(&bytes).into_owned(),
        }),
        status => Err(io_error(io::Error::new(
            io::ErrorKind::InvalidData,
            format!("rank 0 answered with status {status}, not a floe rendezvous"),
        ))),
    }
}
