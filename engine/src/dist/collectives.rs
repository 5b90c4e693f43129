//! Collectives between the ranks of a distributed model: a [`Group`] trait,
//! the single-rank group, and a TCP ring (the MLX ring approach).
//!
//! Every operation has a timeout and returns an error naming the peer when a
//! peer dies, stalls or sends garbage; nothing hangs. Results are identical
//! on every rank, bit for bit (each chunk of an all-reduce is summed once, in
//! a fixed order, then passed around), so ranks never diverge silently.

use std::io::{ErrorKind, IoSlice, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::time::{Duration, Instant};

use crate::dist::ring_security::{RingSecurity, Seal, SEAL_OVERHEAD};

/// Why a collective operation failed.
#[derive(Debug, thiserror::Error)]
pub enum CollectiveError {
    #[error(
        "rank {rank}: could not connect to rank {peer} at {addr} before the deadline: {reason}"
    )]
    Connect {
        rank: usize,
        peer: usize,
        addr: SocketAddr,
        reason: String,
    },
    #[error("rank {rank}: timed out waiting for rank {peer}")]
    Timeout { rank: usize, peer: usize },
    #[error("rank {rank}: rank {peer} closed the connection")]
    PeerClosed { rank: usize, peer: usize },
    #[error("rank {rank}: rank {peer} sent an invalid message: {reason}")]
    Protocol {
        rank: usize,
        peer: usize,
        reason: String,
    },
    #[error("rank {rank}: i/o with rank {peer}: {source}")]
    Io {
        rank: usize,
        peer: usize,
        #[source]
        source: std::io::Error,
    },
    #[error("invalid arguments: {0}")]
    Invalid(String),
}

/// The ranks of one model instance and the operations between them.
pub trait Group: Send {
    fn rank(&self) -> usize;
    fn size(&self) -> usize;
    /// Element-wise sum over all ranks, in place; identical on every rank.
    fn all_reduce_sum(&mut self, data: &mut [f32]) -> Result<(), CollectiveError>;
    /// Concatenates every rank's `local` (rank `r` contributes `counts[r]`
    /// values) into `out`, on every rank.
    fn all_gather(
        &mut self,
        local: &[f32],
        counts: &[usize],
        out: &mut [f32],
    ) -> Result<(), CollectiveError>;
    /// Concatenates every rank's `local` (rank `r` contributes `counts[r]`
    /// values) into `out` on rank 0 only: what only rank 0 reads (the
    /// logits it samples) need not travel to every rank. Elsewhere `out` is
    /// scratch space, left unspecified. Along the ring: rank `r` receives
    /// ranks 1 to `r - 1`'s values from its predecessor and passes them on
    /// with its own, the last rank to rank 0.
    fn gather_to_first(
        &mut self,
        local: &[f32],
        counts: &[usize],
        out: &mut [f32],
    ) -> Result<(), CollectiveError> {
        let (rank, size) = (self.rank(), self.size());
        check_gather(local, counts, out, rank, size)?;
        let first = counts[0];
        if rank == 0 {
            out[..first].copy_from_slice(local);
            return if size > 1 {
                self.recv_prev(&mut out[first..])
            } else {
                Ok(())
            };
        }
        if rank == 1 {
            // Nothing came before: its own values are the whole message.
            return self.send_next(local);
        }
        let own = counts[..rank].iter().sum::<usize>();
        self.recv_prev(&mut out[first..own])?;
        out[own..own + local.len()].copy_from_slice(local);
        self.send_next(&out[first..own + local.len()])
    }
    /// Sends to rank `rank + 1` (pipeline stages).
    fn send_next(&mut self, data: &[f32]) -> Result<(), CollectiveError>;
    /// Receives exactly `out.len()` values from rank `rank - 1`.
    fn recv_prev(&mut self, out: &mut [f32]) -> Result<(), CollectiveError>;
    /// Copies `root`'s `data` to every rank.
    fn broadcast(&mut self, root: usize, data: &mut [f32]) -> Result<(), CollectiveError>;
    /// Returns once every rank has reached it.
    fn barrier(&mut self) -> Result<(), CollectiveError>;
    /// Copies `root`'s message, of any length, to every rank (commands
    /// from the rank that drives generation).
    fn broadcast_bytes(
        &mut self,
        root: usize,
        message: &mut Vec<u8>,
    ) -> Result<(), CollectiveError>;
    /// The longest any wait may take from now on; `None` waits until data
    /// comes or the peer's connection closes (an idle rank between steps).
    fn set_timeout(&mut self, timeout: Option<Duration>) -> Result<(), CollectiveError>;
}

/// A group of one: every operation is local.
pub struct SingleRank;

impl Group for SingleRank {
    fn rank(&self) -> usize {
        0
    }
    fn size(&self) -> usize {
        1
    }
    fn all_reduce_sum(&mut self, _: &mut [f32]) -> Result<(), CollectiveError> {
        Ok(())
    }
    fn all_gather(
        &mut self,
        local: &[f32],
        counts: &[usize],
        out: &mut [f32],
    ) -> Result<(), CollectiveError> {
        check_gather(local, counts, out, 0, 1)?;
        out.copy_from_slice(local);
        Ok(())
    }
    fn send_next(&mut self, _: &[f32]) -> Result<(), CollectiveError> {
        Err(CollectiveError::Invalid(
            "a single rank has no next rank".into(),
        ))
    }
    fn recv_prev(&mut self, _: &mut [f32]) -> Result<(), CollectiveError> {
        Err(CollectiveError::Invalid(
            "a single rank has no previous rank".into(),
        ))
    }
    fn broadcast(&mut self, root: usize, _: &mut [f32]) -> Result<(), CollectiveError> {
        if root == 0 {
            Ok(())
        } else {
            Err(CollectiveError::Invalid(format!(
                "root {root} in a group of 1"
            )))
        }
    }
    fn barrier(&mut self) -> Result<(), CollectiveError> {
        Ok(())
    }
    fn broadcast_bytes(&mut self, root: usize, _: &mut Vec<u8>) -> Result<(), CollectiveError> {
        let mut nothing = [];
        self.broadcast(root, &mut nothing)
    }
    fn set_timeout(&mut self, _: Option<Duration>) -> Result<(), CollectiveError> {
        Ok(())
    }
}

fn check_gather(
    local: &[f32],
    counts: &[usize],
    out: &[f32],
    rank: usize,
    size: usize,
) -> Result<(), CollectiveError> {
    if counts.len() != size
        || counts[rank] != local.len()
        || counts.iter().sum::<usize>() != out.len()
    {
        return Err(CollectiveError::Invalid(format!(
            "gather: counts {counts:?} do not fit a group of {size}, local {} and out {}",
            local.len(),
            out.len()
        )));
    }
    Ok(())
}

/// Frame header: magic, operation sequence number, payload bytes.
const MAGIC: u32 = 0x5445_5352; // "TESR"
/// A connection's first bytes: this magic, the connecting rank (u32), then
/// the ring's id (u16 length, UTF-8). A listener takes only its own ring's
/// predecessor: another instance's rank that reaches this port (placed at
/// once on the same nodes, or left from an instance deleted a moment ago)
/// is turned away, and the listener keeps waiting for the right one.
const HELLO_MAGIC: u32 = 0x5445_5348; // "TESH"
/// The longest ring id a hello carries.
const MAX_RING_ID: usize = 1_024;
/// How long a connection may take to say hello.
const HELLO_WAIT: Duration = Duration::from_secs(2);
const HEADER: usize = 12;
/// The largest byte message a rank accepts (a command with a long prompt is
/// far smaller; anything bigger is garbage).
const MAX_MESSAGE: usize = 256 << 20;
/// All-reduces up to this size gather every rank's whole vector and sum in
/// rank order: n - 1 exchanges instead of 2 (n - 1), which is what decode's
/// small hidden-size vectors need. Larger ones use reduce-scatter.
const GATHER_REDUCE_BYTES: usize = 64 * 1024;
/// Messages up to this size are written before reading: the peer's kernel
/// takes them without the peer reading (a TCP receive buffer starts at
/// 128 KiB on Linux and macOS). Larger ones are written and read in turns,
/// without blocking on either, so two ranks sending to each other at once
/// cannot deadlock. 32 KiB holds an 8-token decode step's all-reduce of a
/// 576-wide model (18 KiB), which the turns made 1.3 us slower (7.8 against
/// 9.5 us, `tessera bench collectives --len 4608`).
const INLINE_WRITE: usize = 32 * 1024;

/// The hello `rank` of ring `ring_id` sends its successor.
fn hello(rank: usize, ring_id: &str) -> Vec<u8> {
    let mut bytes = Vec::with_capacity(10 + ring_id.len());
    bytes.extend_from_slice(&HELLO_MAGIC.to_le_bytes());
    bytes.extend_from_slice(&(rank as u32).to_le_bytes());
    bytes.extend_from_slice(&(ring_id.len() as u16).to_le_bytes());
    bytes.extend_from_slice(ring_id.as_bytes());
    bytes
}

/// Reads a hello: the rank and ring id it claims, or why it is no hello.
fn read_hello(stream: &mut TcpStream) -> Result<(usize, String), String> {
    let mut head = [0u8; 10];
    stream.read_exact(&mut head).map_err(|e| e.to_string())?;
    let word = |i: usize| u32::from_le_bytes([head[i], head[i + 1], head[i + 2], head[i + 3]]);
    if word(0) != HELLO_MAGIC {
        return Err("not a ring hello".into());
    }
    let len = usize::from(u16::from_le_bytes([head[8], head[9]]));
    if len > MAX_RING_ID {
        return Err(format!("a ring id of {len} bytes"));
    }
    let mut id = vec![0u8; len];
    stream.read_exact(&mut id).map_err(|e| e.to_string())?;
    let id = String::from_utf8(id).map_err(|_| "a ring id that is not UTF-8".to_string())?;
    Ok((word(4) as usize, id))
}

/// Accepts connections until one says hello as `prev_rank` of `ring_id`;
/// others are closed (and logged) and the wait goes on until `deadline`.
fn accept_predecessor(
    listener: &TcpListener,
    rank: usize,
    prev_rank: usize,
    ring_id: &str,
    security: &RingSecurity,
    own: SocketAddr,
    deadline: Instant,
) -> Result<(TcpStream, Option<Seal>), CollectiveError> {
    let io = |source| CollectiveError::Io {
        rank,
        peer: prev_rank,
        source,
    };
    listener.set_nonblocking(true).map_err(io)?;
    let mut refused = 0;
    loop {
        let (mut stream, from) = match listener.accept() {
            Ok(accepted) => accepted,
            Err(error) if error.kind() == ErrorKind::WouldBlock && Instant::now() < deadline => {
                std::thread::sleep(Duration::from_millis(5));
                continue;
            }
            Err(error) => {
                return Err(CollectiveError::Connect {
                    rank,
                    peer: prev_rank,
                    addr: own,
                    reason: format!(
                    "no connection from the previous rank ({refused} others turned away): {error}"
                ),
                })
            }
        };
        stream.set_nonblocking(false).map_err(io)?;
        stream.set_read_timeout(Some(HELLO_WAIT)).map_err(io)?;
        match read_hello(&mut stream) {
            Ok((claimed, id)) if claimed == prev_rank && id == ring_id => {
                match welcome(&mut stream, rank, prev_rank, ring_id, security) {
                    Ok(seal) => return Ok((stream, seal)),
                    Err(reason) => {
                        tracing::warn!(rank, %from, reason, "ring: turned away a connection")
                    }
                }
            }
            Ok((claimed, id)) => {
                tracing::warn!(
                    rank,
                    %from,
                    claimed_rank = claimed,
                    claimed_ring = id,
                    ring = ring_id,
                    "ring: turned away a rank of another ring"
                );
            }
            Err(reason) => tracing::warn!(rank, %from, reason, "ring: turned away a connection"),
        }
        refused += 1;
    }
}

/// The listener's side of the proofs: checks the connector's, answers with
/// its own, and returns the sealing of the frames it will receive.
fn welcome(
    stream: &mut TcpStream,
    rank: usize,
    prev_rank: usize,
    ring_id: &str,
    security: &RingSecurity,
) -> Result<Option<Seal>, String> {
    if !security.is_authenticated() {
        return Ok(None);
    }
    let mut proof = vec![0u8; security.connector_proof_len()];
    stream.read_exact(&mut proof).map_err(|e| e.to_string())?;
    if !security.check_connector(ring_id, prev_rank, &proof) {
        return Err("a rank that does not know the instance's ring secret".into());
    }
    let connector_nonce = &proof[..crate::dist::ring_security::NONCE_BYTES];
    let (answer, listener_nonce) = security.listener_proof(ring_id, rank, connector_nonce)?;
    stream.write_all(&answer).map_err(|e| e.to_string())?;
    Ok(security.seal_for(connector_nonce, &listener_nonce))
}

/// The connector's side, once its own predecessor is in: checks the
/// listener's answer and returns the sealing of the frames it will send.
fn check_welcome(
    stream: &mut TcpStream,
    next_rank: usize,
    ring_id: &str,
    security: &RingSecurity,
    connector_nonce: &[u8],
) -> Result<Option<Seal>, String> {
    if !security.is_authenticated() {
        return Ok(None);
    }
    stream
        .set_read_timeout(Some(HELLO_WAIT))
        .map_err(|e| e.to_string())?;
    let mut answer = vec![0u8; security.connector_proof_len()];
    stream.read_exact(&mut answer).map_err(|e| e.to_string())?;
    if !security.check_listener(ring_id, next_rank, connector_nonce, &answer) {
        return Err("the next rank does not know the instance's ring secret".into());
    }
    let listener_nonce = &answer[..crate::dist::ring_security::NONCE_BYTES];
    Ok(security.seal_for(connector_nonce, listener_nonce))
}

/// A ring of TCP connections: each rank talks to `rank + 1` and `rank - 1`.
pub struct TcpRing {
    rank: usize,
    size: usize,
    next: TcpStream,
    prev: TcpStream,
    sequence: u32,
    send_buffer: Vec<u8>,
    recv_buffer: Vec<u8>,
    gathered: Vec<f32>,
    /// Sealing of the frames sent to the next rank and read from the
    /// previous one (a secured cluster's rings).
    seal_next: Option<Seal>,
    open_prev: Option<Seal>,
    /// The longest a wait may take (the sockets' own timeouts), for the
    /// exchanges that poll both sockets.
    timeout: Option<Duration>,
}

impl TcpRing {
    /// Binds `addrs[rank]` and joins ring `ring_id` (an instance's id: only
    /// ranks that name the same id are taken), retrying until `deadline`.
    pub fn connect(
        rank: usize,
        addrs: &[SocketAddr],
        ring_id: &str,
        connect_within: Duration,
        op_timeout: Duration,
    ) -> Result<Self, CollectiveError> {
        Self::connect_secured(
            rank,
            addrs,
            ring_id,
            &RingSecurity::open(),
            connect_within,
            op_timeout,
        )
    }

    /// [`TcpRing::connect`] with the ranks' proofs (and sealed frames) of
    /// `security`.
    pub fn connect_secured(
        rank: usize,
        addrs: &[SocketAddr],
        ring_id: &str,
        security: &RingSecurity,
        connect_within: Duration,
        op_timeout: Duration,
    ) -> Result<Self, CollectiveError> {
        let listener = TcpListener::bind(addrs.get(rank).copied().ok_or_else(|| {
            CollectiveError::Invalid(format!("rank {rank} of a ring of {}", addrs.len()))
        })?)
        .map_err(|source| CollectiveError::Io {
            rank,
            peer: rank,
            source,
        })?;
        Self::join(
            rank,
            listener,
            addrs,
            ring_id,
            security,
            connect_within,
            op_timeout,
        )
    }

    /// Joins the ring with an already bound listener (tests bind port 0).
    pub fn from_listener(
        rank: usize,
        listener: TcpListener,
        addrs: &[SocketAddr],
        ring_id: &str,
        connect_within: Duration,
        op_timeout: Duration,
    ) -> Result<Self, CollectiveError> {
        let open = RingSecurity::open();
        Self::join(
            rank,
            listener,
            addrs,
            ring_id,
            &open,
            connect_within,
            op_timeout,
        )
    }

    /// Joins ring `ring_id` on `listener`, proving (and asking) knowledge
    /// of `security`'s secret, sealing frames where it says so.
    pub fn join(
        rank: usize,
        listener: TcpListener,
        addrs: &[SocketAddr],
        ring_id: &str,
        security: &RingSecurity,
        connect_within: Duration,
        op_timeout: Duration,
    ) -> Result<Self, CollectiveError> {
        let size = addrs.len();
        if size < 2 || rank >= size {
            return Err(CollectiveError::Invalid(format!(
                "rank {rank} of a ring of {size}"
            )));
        }
        if ring_id.len() > MAX_RING_ID {
            return Err(CollectiveError::Invalid(format!(
                "a ring id of {} bytes (at most {MAX_RING_ID})",
                ring_id.len()
            )));
        }
        let deadline = Instant::now() + connect_within;
        let next_rank = (rank + 1) % size;
        let prev_rank = (rank + size - 1) % size;
        let io = |peer: usize| move |source| CollectiveError::Io { rank, peer, source };
        // Connect out first (the listener queues our predecessor meanwhile).
        let next = loop {
            match TcpStream::connect_timeout(&addrs[next_rank], Duration::from_millis(200)) {
                Ok(stream) => break stream,
                Err(error) if Instant::now() < deadline => {
                    tracing::debug!(rank, peer = next_rank, %error, "ring: retrying connect");
                    std::thread::sleep(Duration::from_millis(20));
                }
                Err(error) => {
                    return Err(CollectiveError::Connect {
                        rank,
                        peer: next_rank,
                        addr: addrs[next_rank],
                        reason: error.to_string(),
                    })
                }
            }
        };
        next.set_nodelay(true).map_err(io(next_rank))?;
        let mut next = next;
        let (proof, connector_nonce) = security
            .connector_proof(ring_id, rank)
            .map_err(CollectiveError::Invalid)?;
        let mut greeting = hello(rank, ring_id);
        greeting.extend_from_slice(&proof);
        next.write_all(&greeting).map_err(io(next_rank))?;
        let (prev, open_prev) = accept_predecessor(
            &listener,
            rank,
            prev_rank,
            ring_id,
            security,
            addrs[rank],
            deadline,
        )?;
        let seal_next = check_welcome(&mut next, next_rank, ring_id, security, &connector_nonce)
            .map_err(|reason| CollectiveError::Connect {
                rank,
                peer: next_rank,
                addr: addrs[next_rank],
                reason,
            })?;
        // Reads poll briefly before they block (see `read_full`).
        prev.set_nonblocking(true).map_err(io(prev_rank))?;
        prev.set_nodelay(true).map_err(io(prev_rank))?;
        for stream in [&next, &prev] {
            stream
                .set_read_timeout(Some(op_timeout))
                .map_err(io(prev_rank))?;
            stream
                .set_write_timeout(Some(op_timeout))
                .map_err(io(next_rank))?;
        }
        tracing::info!(
            rank,
            ring = ring_id,
            authenticated = security.is_authenticated(),
            sealed = seal_next.is_some(),
            "ring: joined"
        );
        Ok(Self {
            rank,
            size,
            next,
            prev,
            sequence: 0,
            timeout: Some(op_timeout),
            send_buffer: Vec::new(),
            recv_buffer: Vec::new(),
            gathered: Vec::new(),
            seal_next,
            open_prev,
        })
    }

    /// Bytes a frame of `plain` bytes takes on the wire.
    fn wire_len(&self, plain: usize) -> usize {
        plain
            + if self.open_prev.is_some() {
                SEAL_OVERHEAD
            } else {
                0
            }
    }

    /// Readies the frame of `values` for sending; returns the bytes that go
    /// after `send_buffer`. On an open ring of a little-endian machine,
    /// `send_buffer` holds just the header and the values go from the
    /// caller's slice as they are: their bytes are the wire's little-endian
    /// floats, so a step's logits are not copied on their way out. Else
    /// `send_buffer` holds the whole frame, sealed if the ring is.
    fn prepare_frame<'v>(
        &mut self,
        sequence: u32,
        values: &'v [f32],
    ) -> Result<&'v [u8], CollectiveError> {
        if self.seal_next.is_none() && cfg!(target_endian = "little") {
            frame_header(&mut self.send_buffer, sequence, values.len() * 4);
            return Ok(bytemuck::cast_slice(values));
        }
        frame_floats(&mut self.send_buffer, sequence, values);
        self.seal_outgoing(0)?;
        Ok(&[])
    }

    /// Seals `send_buffer[from..]` when frames are sealed.
    fn seal_outgoing(&mut self, from: usize) -> Result<(), CollectiveError> {
        let Some(seal) = self.seal_next.as_mut() else {
            return Ok(());
        };
        let peer = (self.rank + 1) % self.size;
        seal.seal(&mut self.send_buffer, from)
            .map_err(|reason| CollectiveError::Protocol {
                rank: self.rank,
                peer,
                reason,
            })
    }

    /// Opens a received frame in place when frames are sealed.
    fn open_incoming(&mut self, frame: &mut [u8]) -> Result<(), CollectiveError> {
        let Some(seal) = self.open_prev.as_mut() else {
            return Ok(());
        };
        let peer = (self.rank + self.size - 1) % self.size;
        seal.open(frame)
            .map_err(|reason| CollectiveError::Protocol {
                rank: self.rank,
                peer,
                reason,
            })
    }

    fn prev_rank(&self) -> usize {
        (self.rank + self.size - 1) % self.size
    }

    fn next_rank(&self) -> usize {
        (self.rank + 1) % self.size
    }

    fn map_io(&self, peer: usize, source: std::io::Error) -> CollectiveError {
        match source.kind() {
            ErrorKind::WouldBlock | ErrorKind::TimedOut => CollectiveError::Timeout {
                rank: self.rank,
                peer,
            },
            ErrorKind::UnexpectedEof
            | ErrorKind::ConnectionReset
            | ErrorKind::BrokenPipe
            | ErrorKind::ConnectionAborted => CollectiveError::PeerClosed {
                rank: self.rank,
                peer,
            },
            _ => CollectiveError::Io {
                rank: self.rank,
                peer,
                source,
            },
        }
    }

    fn read_exact_from_prev(&mut self, buf: &mut [u8]) -> Result<(), CollectiveError> {
        let peer = self.prev_rank();
        read_full(&mut self.prev, buf).map_err(|e| self.map_io(peer, e))
    }

    /// Sends `send` to the next rank while receiving `recv.len()` values
    /// from the previous one.
    fn exchange(&mut self, send: &[f32], recv_len: usize) -> Result<(), CollectiveError> {
        self.sequence = self.sequence.wrapping_add(1);
        let sequence = self.sequence;
        let body = self.prepare_frame(sequence, send)?;
        let (next_rank, prev_rank) = (self.next_rank(), self.prev_rank());
        let wire = self.wire_len(HEADER + recv_len * 4);
        self.recv_buffer.resize(wire, 0);
        let rank = self.rank;
        let (next, prev) = (&mut self.next, &mut self.prev);
        let (head, recv_buffer) = (&self.send_buffer[..], &mut self.recv_buffer);
        let (write_result, read_result) = if head.len() + body.len() <= INLINE_WRITE {
            let written = write_parts(next, head, body);
            let read = if written.is_ok() {
                read_full(prev, recv_buffer)
            } else {
                Ok(())
            };
            (written, read)
        } else {
            write_while_reading(next, (head, body), prev, recv_buffer, self.timeout)
        };
        write_result.map_err(|e| self.map_io(next_rank, e))?;
        read_result.map_err(|e| self.map_io(prev_rank, e))?;
        let mut received = std::mem::take(&mut self.recv_buffer);
        let opened = self.open_incoming(&mut received);
        self.recv_buffer = received;
        opened?;
        let header = |i: usize| {
            u32::from_le_bytes([
                self.recv_buffer[i],
                self.recv_buffer[i + 1],
                self.recv_buffer[i + 2],
                self.recv_buffer[i + 3],
            ])
        };
        let (magic, their_sequence, bytes) = (header(0), header(4), header(8) as usize);
        if magic != MAGIC || their_sequence != sequence || bytes != recv_len * 4 {
            return Err(CollectiveError::Protocol {
                rank,
                peer: prev_rank,
                reason: format!(
                    "expected frame {sequence} of {} bytes, got magic {magic:#x}, frame {their_sequence}, {bytes} bytes",
                    recv_len * 4
                ),
            });
        }
        Ok(())
    }

    /// All-reduce by gathering every rank's whole vector, then summing in
    /// rank order: the same additions in the same order on every rank, so
    /// the results agree bit for bit.
    fn gather_reduce(&mut self, data: &mut [f32]) -> Result<(), CollectiveError> {
        let (n, len) = (self.size, data.len());
        if n == 2 {
            // One addition per value, the same on both ranks (a sum of two
            // is the same either way round): no gathered copy needed.
            self.exchange(data, len)?;
            for (value, got) in data.iter_mut().zip(self.received()) {
                *value += got;
            }
            return Ok(());
        }
        let mut gathered = std::mem::take(&mut self.gathered);
        gathered.resize(n * len, 0.0);
        gathered[self.rank * len..(self.rank + 1) * len].copy_from_slice(data);
        let mut result = Ok(());
        for step in 0..n - 1 {
            let send_rank = (self.rank + n - step) % n;
            let recv_rank = (self.rank + n - step - 1) % n;
            result = self.exchange(&gathered[send_rank * len..(send_rank + 1) * len], len);
            if result.is_err() {
                break;
            }
            let into = &mut gathered[recv_rank * len..(recv_rank + 1) * len];
            for (value, got) in into.iter_mut().zip(self.received()) {
                *value = got;
            }
        }
        if result.is_ok() {
            for (i, value) in data.iter_mut().enumerate() {
                let mut sum = gathered[i];
                for r in 1..n {
                    sum += gathered[r * len + i];
                }
                *value = sum;
            }
        }
        self.gathered = gathered;
        result
    }

    /// Writes one frame of raw bytes to the next rank.
    fn send_bytes_next(&mut self, payload: &[u8]) -> Result<(), CollectiveError> {
        self.send_buffer.clear();
        self.send_buffer.extend_from_slice(&MAGIC.to_le_bytes());
        self.send_buffer
            .extend_from_slice(&self.sequence.to_le_bytes());
        self.send_buffer
            .extend_from_slice(&(payload.len() as u32).to_le_bytes());
        // Header and payload sealed apart: the reader learns the length
        // from an opened header.
        self.seal_outgoing(0)?;
        let body = self.send_buffer.len();
        self.send_buffer.extend_from_slice(payload);
        self.seal_outgoing(body)?;
        let peer = self.next_rank();
        let result = self.next.write_all(&self.send_buffer);
        result.map_err(|e| self.map_io(peer, e))
    }

    /// Reads one frame of raw bytes, of whatever length it announces (up to
    /// [`MAX_MESSAGE`]), from the previous rank.
    fn recv_bytes_prev(&mut self, out: &mut Vec<u8>) -> Result<(), CollectiveError> {
        let mut header = vec![0u8; self.wire_len(HEADER)];
        self.read_exact_from_prev(&mut header)?;
        self.open_incoming(&mut header)?;
        let word =
            |i: usize| u32::from_le_bytes([header[i], header[i + 1], header[i + 2], header[i + 3]]);
        let (magic, bytes) = (word(0), word(8) as usize);
        if magic != MAGIC || bytes > MAX_MESSAGE {
            return Err(CollectiveError::Protocol {
                rank: self.rank,
                peer: self.prev_rank(),
                reason: format!("expected a message, got magic {magic:#x} and {bytes} bytes"),
            });
        }
        out.resize(self.wire_len(bytes), 0);
        self.read_exact_from_prev(out)?;
        self.open_incoming(out)?;
        out.truncate(bytes);
        Ok(())
    }

    /// Checks a point-to-point frame's header: the magic and `values`
    /// floats.
    fn check_values_header(
        &self,
        header: &[u8; HEADER],
        values: usize,
    ) -> Result<(), CollectiveError> {
        let word =
            |i: usize| u32::from_le_bytes([header[i], header[i + 1], header[i + 2], header[i + 3]]);
        let (magic, bytes) = (word(0), word(8) as usize);
        if magic == MAGIC && bytes == values * 4 {
            return Ok(());
        }
        Err(CollectiveError::Protocol {
            rank: self.rank,
            peer: self.prev_rank(),
            reason: format!(
                "expected {} bytes, got magic {magic:#x} and {bytes} bytes",
                values * 4
            ),
        })
    }

    /// The floats of the last frame received, in order.
    fn received(&self) -> impl Iterator<Item = f32> + '_ {
        self.recv_buffer[HEADER..]
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
    }
}

/// Writes a frame of `values` (header, then little-endian floats) into
/// `buffer`.
fn frame_floats(buffer: &mut Vec<u8>, sequence: u32, values: &[f32]) {
    frame_header(buffer, sequence, values.len() * 4);
    buffer.resize(HEADER + values.len() * 4, 0);
    for (bytes, value) in buffer[HEADER..].chunks_exact_mut(4).zip(values) {
        bytes.copy_from_slice(&value.to_le_bytes());
    }
}

/// Writes a frame's header (magic, sequence number, payload bytes) into
/// `buffer`, replacing what it held.
fn frame_header(buffer: &mut Vec<u8>, sequence: u32, bytes: usize) {
    buffer.clear();
    buffer.extend_from_slice(&MAGIC.to_le_bytes());
    buffer.extend_from_slice(&sequence.to_le_bytes());
    buffer.extend_from_slice(&(bytes as u32).to_le_bytes());
}

/// Writes `head` then `body` to a blocking stream, both in one system call
/// where the kernel takes them.
fn write_parts<'a>(
    stream: &mut TcpStream,
    mut head: &'a [u8],
    mut body: &'a [u8],
) -> std::io::Result<()> {
    while !head.is_empty() || !body.is_empty() {
        match stream.write_vectored(&[IoSlice::new(head), IoSlice::new(body)]) {
            Ok(0) => return Err(ErrorKind::WriteZero.into()),
            Ok(n) => (head, body) = advance_parts(head, body, n),
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// What is left of `head` then `body` once `written` bytes of them are out.
fn advance_parts<'a>(head: &'a [u8], body: &'a [u8], written: usize) -> (&'a [u8], &'a [u8]) {
    match head.get(written..) {
        Some(rest) => (rest, body),
        None => (&[], body.get(written - head.len()..).unwrap_or_default()),
    }
}

/// How long a read polls before it blocks. A decode step's all-reduce
/// waits only for the other ranks' share of one layer, so the data usually
/// comes within this; polling saves the wake-up of a blocked thread (tens of
/// microseconds).
const POLL_BEFORE_BLOCKING: Duration = Duration::from_micros(500);

/// How long a poll spins before it starts yielding the core between tries.
/// A yield costs about 10 µs on the VMs measured (an all-reduce of 576
/// values between two local ranks: 22 µs median when every try yielded,
/// 10 µs spinning); after this, yielding lets an oversubscribed machine run
/// the thread being waited for.
const SPIN_BEFORE_YIELDING: Duration = Duration::from_micros(50);

/// Between two tries of a poll that has waited `idle`: spin at first, then
/// yield the core.
fn pause_polling(idle: Duration) {
    if idle < SPIN_BEFORE_YIELDING {
        std::hint::spin_loop();
    } else {
        std::thread::yield_now();
    }
}

/// Fills `buf` from `stream` (non-blocking): polls for a while, then waits
/// in the kernel, bounded by the stream's read timeout.
fn read_full(stream: &mut TcpStream, buf: &mut [u8]) -> std::io::Result<()> {
    let mut filled = 0;
    let started = Instant::now();
    while filled < buf.len() {
        match stream.read(&mut buf[filled..]) {
            Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
            Ok(n) => filled += n,
            Err(e) if e.kind() == ErrorKind::Interrupted => {}
            Err(e) if e.kind() == ErrorKind::WouldBlock => {
                let idle = started.elapsed();
                if idle < POLL_BEFORE_BLOCKING {
                    pause_polling(idle);
                    continue;
                }
                stream.set_nonblocking(false)?;
                let read = stream.read(&mut buf[filled..]);
                stream.set_nonblocking(true)?;
                match read {
                    Ok(0) => return Err(ErrorKind::UnexpectedEof.into()),
                    Ok(n) => filled += n,
                    Err(e) if e.kind() == ErrorKind::Interrupted => {}
                    Err(e) => return Err(e),
                }
            }
            Err(e) => return Err(e),
        }
    }
    Ok(())
}

/// Writes `send` to `next` while filling `recv` from `prev`, in turns and
/// without blocking on either while both are unfinished: two ranks sending
/// each other more than the kernel buffers cannot deadlock, and no thread
/// is spawned per exchange. Once one side is done the other blocks as a
/// lone read or write would (the peer has finished writing to us, or we
/// to it, so it is reading or about to). `timeout` bounds every wait
/// without progress. Returns the write's and the read's results.
fn write_while_reading<'a>(
    next: &mut TcpStream,
    send: (&'a [u8], &'a [u8]),
    prev: &mut TcpStream,
    recv: &mut [u8],
    timeout: Option<Duration>,
) -> (std::io::Result<()>, std::io::Result<()>) {
    if let Err(error) = next.set_nonblocking(true) {
        return (Err(error), Ok(()));
    }
    let ((mut head, mut body), mut filled) = (send, 0);
    let mut last_progress = Instant::now();
    let result = loop {
        if head.is_empty() && body.is_empty() {
            break (Ok(()), read_full(prev, &mut recv[filled..]));
        }
        if filled == recv.len() {
            let write = next
                .set_nonblocking(false)
                .and_then(|()| write_parts(next, head, body));
            break (write, Ok(()));
        }
        let mut progressed = false;
        match next.write_vectored(&[IoSlice::new(head), IoSlice::new(body)]) {
            Ok(0) => break (Err(ErrorKind::WriteZero.into()), Ok(())),
            Ok(n) => ((head, body), progressed) = (advance_parts(head, body, n), true),
            Err(e) if is_retry(&e) => {}
            Err(e) => break (Err(e), Ok(())),
        }
        match prev.read(&mut recv[filled..]) {
            Ok(0) => break (Ok(()), Err(ErrorKind::UnexpectedEof.into())),
            Ok(n) => (filled, progressed) = (filled + n, true),
            Err(e) if is_retry(&e) => {}
            Err(e) => break (Ok(()), Err(e)),
        }
        if progressed {
            last_progress = Instant::now();
            continue;
        }
        let idle = last_progress.elapsed();
        if timeout.is_some_and(|limit| idle >= limit) {
            break (Ok(()), Err(ErrorKind::TimedOut.into()));
        }
        if idle < POLL_BEFORE_BLOCKING {
            pause_polling(idle);
        } else {
            std::thread::sleep(Duration::from_micros(50));
        }
    };
    match next.set_nonblocking(false) {
        Ok(()) => result,
        Err(error) => (Err(error), result.1),
    }
}

fn is_retry(error: &std::io::Error) -> bool {
    matches!(error.kind(), ErrorKind::WouldBlock | ErrorKind::Interrupted)
}

/// Chunk `index` of `len` values split into `parts` (the first ones larger).
fn chunk(len: usize, parts: usize, index: usize) -> std::ops::Range<usize> {
    let start = len * index / parts;
    let end = len * (index + 1) / parts;
    start..end
}

impl Group for TcpRing {
    fn rank(&self) -> usize {
        self.rank
    }

    fn size(&self) -> usize {
        self.size
    }

    fn all_reduce_sum(&mut self, data: &mut [f32]) -> Result<(), CollectiveError> {
        let (n, len) = (self.size, data.len());
        if n == 2 || len * 4 <= GATHER_REDUCE_BYTES {
            return self.gather_reduce(data);
        }
        // Reduce-scatter: after n-1 steps, rank r holds the full sum of
        // chunk (r + 1) % n, summed in ring order starting at that chunk's
        // owner. Then all-gather passes the finished chunks around.
        for step in 0..n - 1 {
            let send_chunk = chunk(len, n, (self.rank + n - step) % n);
            let recv_chunk = chunk(len, n, (self.rank + n - step - 1) % n);
            self.exchange(&data[send_chunk], recv_chunk.len())?;
            for (value, got) in data[recv_chunk].iter_mut().zip(self.received()) {
                *value += got;
            }
        }
        for step in 0..n - 1 {
            let send_chunk = chunk(len, n, (self.rank + 1 + n - step) % n);
            let recv_chunk = chunk(len, n, (self.rank + n - step) % n);
            self.exchange(&data[send_chunk], recv_chunk.len())?;
            for (value, got) in data[recv_chunk].iter_mut().zip(self.received()) {
                *value = got;
            }
        }
        Ok(())
    }

    fn all_gather(
        &mut self,
        local: &[f32],
        counts: &[usize],
        out: &mut [f32],
    ) -> Result<(), CollectiveError> {
        check_gather(local, counts, out, self.rank, self.size)?;
        let n = self.size;
        let offset = |r: usize| counts[..r].iter().sum::<usize>();
        let own = offset(self.rank);
        out[own..own + local.len()].copy_from_slice(local);
        for step in 0..n - 1 {
            let send_rank = (self.rank + n - step) % n;
            let recv_rank = (self.rank + n - step - 1) % n;
            let send_range = offset(send_rank)..offset(send_rank) + counts[send_rank];
            self.exchange(&out[send_range], counts[recv_rank])?;
            let at = offset(recv_rank);
            let into = &mut out[at..at + counts[recv_rank]];
            for (value, got) in into.iter_mut().zip(self.received()) {
                *value = got;
            }
        }
        Ok(())
    }

    fn send_next(&mut self, data: &[f32]) -> Result<(), CollectiveError> {
        // Point-to-point frames carry the current number without advancing
        // it: only the symmetric operations keep ranks' numbers in step.
        let body = self.prepare_frame(self.sequence, data)?;
        let peer = self.next_rank();
        let result = write_parts(&mut self.next, &self.send_buffer, body);
        result.map_err(|e| self.map_io(peer, e))
    }

    fn recv_prev(&mut self, out: &mut [f32]) -> Result<(), CollectiveError> {
        if self.open_prev.is_none() && cfg!(target_endian = "little") {
            // Straight into `out`: the wire's little-endian floats are its
            // bytes (see `prepare_frame`).
            let mut header = [0u8; HEADER];
            self.read_exact_from_prev(&mut header)?;
            self.check_values_header(&header, out.len())?;
            return self.read_exact_from_prev(bytemuck::cast_slice_mut(out));
        }
        let mut recv = std::mem::take(&mut self.recv_buffer);
        recv.resize(self.wire_len(HEADER + out.len() * 4), 0);
        let result = self
            .read_exact_from_prev(&mut recv)
            .and_then(|()| self.open_incoming(&mut recv));
        self.recv_buffer = recv;
        result?;
        let mut header = [0u8; HEADER];
        header.copy_from_slice(&self.recv_buffer[..HEADER]);
        self.check_values_header(&header, out.len())?;
        for (value, got) in out.iter_mut().zip(self.received()) {
            *value = got;
        }
        Ok(())
    }

    fn broadcast(&mut self, root: usize, data: &mut [f32]) -> Result<(), CollectiveError> {
        if root >= self.size {
            return Err(CollectiveError::Invalid(format!(
                "root {root} in a group of {}",
                self.size
            )));
        }
        // Along the ring from the root; the rank just before it only receives.
        let distance = (self.rank + self.size - root) % self.size;
        if distance != 0 {
            self.recv_prev(data)?;
        }
        if distance != self.size - 1 {
            self.send_next(data)?;
        }
        Ok(())
    }

    fn barrier(&mut self) -> Result<(), CollectiveError> {
        let mut token = [0.0f32];
        self.all_reduce_sum(&mut token)
    }

    fn broadcast_bytes(
        &mut self,
        root: usize,
        message: &mut Vec<u8>,
    ) -> Result<(), CollectiveError> {
        if root >= self.size {
            return Err(CollectiveError::Invalid(format!(
                "root {root} in a group of {}",
                self.size
            )));
        }
        let distance = (self.rank + self.size - root) % self.size;
        if distance != 0 {
            self.recv_bytes_prev(message)?;
        }
        if distance != self.size - 1 {
            let payload = std::mem::take(message);
            let result = self.send_bytes_next(&payload);
            *message = payload;
            result?;
        }
        Ok(())
    }

    fn set_timeout(&mut self, timeout: Option<Duration>) -> Result<(), CollectiveError> {
        let (rank, next_rank, prev_rank) = (self.rank, self.next_rank(), self.prev_rank());
        let io = |peer: usize| move |source| CollectiveError::Io { rank, peer, source };
        self.prev.set_read_timeout(timeout).map_err(io(prev_rank))?;
        self.next
            .set_write_timeout(timeout)
            .map_err(io(next_rank))?;
        self.timeout = timeout;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const TIMEOUT: Duration = Duration::from_secs(5);

    /// Runs `body` on `n` ranks of a loopback ring, one thread each.
    fn on_ring<T: Send + 'static>(
        n: usize,
        body: impl Fn(&mut TcpRing) -> T + Send + Sync + Clone + 'static,
    ) -> Vec<T> {
        on_secured_ring(n, RingSecurity::open(), body)
    }

    /// [`on_ring`] with every rank's `security`.
    fn on_secured_ring<T: Send + 'static>(
        n: usize,
        security: RingSecurity,
        body: impl Fn(&mut TcpRing) -> T + Send + Sync + Clone + 'static,
    ) -> Vec<T> {
        let (listeners, addrs) = tessera_testkit::loopback_listeners(n);
        let handles: Vec<_> = listeners
            .into_iter()
            .enumerate()
            .map(|(rank, listener)| {
                let addrs = addrs.clone();
                let (body, security) = (body.clone(), security.clone());
                std::thread::spawn(move || {
                    let mut ring =
                        TcpRing::join(rank, listener, &addrs, "test", &security, TIMEOUT, TIMEOUT)
                            .expect("ring");
                    body(&mut ring)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().expect("rank thread"))
            .collect()
    }

    fn values(rank: usize, len: usize) -> Vec<f32> {
        (0..len)
            .map(|i| ((i * 7 + rank * 13) % 17) as f32 * 0.1 - 0.7)
            .collect()
    }

    #[test]
    fn all_reduce_is_the_sum_and_identical_everywhere() {
        for n in [2, 3, 4] {
            for len in [1, 5, 576, 40_000] {
                let results = on_ring(n, move |ring| {
                    let mut data = values(ring.rank(), len);
                    ring.all_reduce_sum(&mut data).expect("all-reduce");
                    data
                });
                let inputs: Vec<Vec<f32>> = (0..n).map(|r| values(r, len)).collect();
                for i in 0..len {
                    let want: f32 = inputs.iter().map(|v| v[i]).sum();
                    assert!((results[0][i] - want).abs() < 1e-4, "n {n} len {len} i {i}");
                }
                for other in &results[1..] {
                    assert!(other
                        .iter()
                        .zip(&results[0])
                        .all(|(a, b)| a.to_bits() == b.to_bits()));
                }
            }
        }
    }

    #[test]
    fn gather_broadcast_pipeline_and_barrier() {
        let results = on_ring(3, |ring| {
            let counts = [2, 1, 3];
            let local = vec![ring.rank() as f32; counts[ring.rank()]];
            let mut gathered = vec![0.0; 6];
            ring.all_gather(&local, &counts, &mut gathered)
                .expect("gather");
            let mut data = if ring.rank() == 1 {
                vec![4.0, 5.0]
            } else {
                vec![0.0; 2]
            };
            ring.broadcast(1, &mut data).expect("broadcast");
            ring.barrier().expect("barrier");
            // Pipeline: 0 → 1 → 2.
            let mut hidden = vec![0.0f32; 3];
            if ring.rank() == 0 {
                ring.send_next(&[1.0, 2.0, 3.0]).expect("send");
            } else {
                ring.recv_prev(&mut hidden).expect("recv");
                hidden.iter_mut().for_each(|v| *v *= 2.0);
                if ring.rank() == 1 {
                    ring.send_next(&hidden).expect("send");
                }
            }
            ring.barrier().expect("barrier");
            (gathered, data, hidden)
        });
        for (gathered, data, _) in &results {
            assert_eq!(gathered, &[0.0, 0.0, 1.0, 2.0, 2.0, 2.0]);
            assert_eq!(data, &[4.0, 5.0]);
        }
        assert_eq!(results[2].2, vec![4.0, 8.0, 12.0]);
    }

    #[test]
    fn gathering_to_the_first_rank_fills_only_its_output() {
        for n in [2, 3, 4] {
            let results = on_ring(n, move |ring| {
                let counts: Vec<usize> = (0..n).map(|r| r + 1).collect();
                let local: Vec<f32> = (0..counts[ring.rank()])
                    .map(|i| (10 * ring.rank() + i) as f32)
                    .collect();
                let mut out = vec![-1.0; counts.iter().sum()];
                ring.gather_to_first(&local, &counts, &mut out)
                    .expect("gather");
                // The ring still works in step afterwards.
                ring.barrier().expect("barrier");
                out
            });
            let expected: Vec<f32> = (0..n)
                .flat_map(|r| (0..=r).map(move |i| (10 * r + i) as f32))
                .collect();
            assert_eq!(results[0], expected, "world {n}");
        }
        let mut out = vec![0.0; 2];
        SingleRank
            .gather_to_first(&[1.0, 2.0], &[2], &mut out)
            .expect("a single rank gathers its own");
        assert_eq!(out, [1.0, 2.0]);
        let error = SingleRank.gather_to_first(&[1.0], &[2], &mut out);
        assert!(matches!(error, Err(CollectiveError::Invalid(_))));
    }

    #[test]
    fn advancing_parts_crosses_from_head_to_body() {
        let (head, body) = ([1u8, 2, 3].as_slice(), [4u8, 5].as_slice());
        assert_eq!(advance_parts(head, body, 0), (head, body));
        assert_eq!(advance_parts(head, body, 2), (&[3u8][..], body));
        assert_eq!(advance_parts(head, body, 3), (&[][..], body));
        assert_eq!(advance_parts(head, body, 4), (&[][..], &[5u8][..]));
        assert_eq!(advance_parts(head, body, 5), (&[][..], &[][..]));
    }

    #[test]
    fn a_dead_peer_is_an_error_not_a_hang() {
        let started = Instant::now();
        let results = on_ring(3, |ring| {
            if ring.rank() == 2 {
                return None; // drops its connections: a crashed rank
            }
            let mut data = vec![1.0f32; 100];
            Some(ring.all_reduce_sum(&mut data).map_err(|e| e.to_string()))
        });
        assert!(started.elapsed() < Duration::from_secs(12));
        for result in results.into_iter().flatten() {
            let error = result.expect_err("the ring is broken");
            assert!(
                error.contains("rank 2") || error.contains("closed") || error.contains("timed out"),
                "{error}"
            );
        }
    }

    /// Far more than loopback sockets buffer, sent both ways at once: the
    /// exchange must interleave writing and reading rather than deadlock.
    #[test]
    fn exchanges_larger_than_the_socket_buffers_complete() {
        let len = 4 << 20;
        let results = on_ring(2, move |ring| {
            let mut data = values(ring.rank(), len);
            ring.all_reduce_sum(&mut data).expect("all-reduce");
            let counts = [len, len];
            let mut gathered = vec![0.0; 2 * len];
            let local = values(ring.rank(), len);
            ring.all_gather(&local, &counts, &mut gathered)
                .expect("gather");
            (data, gathered)
        });
        let (a, b) = (values(0, len), values(1, len));
        for (data, gathered) in &results {
            assert!(data.iter().enumerate().all(|(i, v)| *v == a[i] + b[i]));
            assert_eq!(&gathered[..len], &a[..]);
            assert_eq!(&gathered[len..], &b[..]);
        }
    }

    /// A peer that stops reading and writing mid-exchange: the waiting
    /// rank gets a timeout naming it, within the ring's timeout.
    #[test]
    fn a_large_exchange_with_a_stalled_peer_times_out() {
        let started = Instant::now();
        let results = on_ring(2, |ring| {
            if ring.rank() == 1 {
                // Stalls, connections open, past rank 0's timeout.
                std::thread::sleep(Duration::from_secs(3));
                return None;
            }
            ring.set_timeout(Some(Duration::from_secs(1)))
                .expect("timeout");
            let mut data = vec![1.0f32; 4 << 20];
            Some(ring.all_reduce_sum(&mut data).map_err(|e| e.to_string()))
        });
        assert!(started.elapsed() < Duration::from_secs(8));
        let error = results[0]
            .clone()
            .expect("rank 0 ran")
            .expect_err("rank 1 never answered");
        assert!(error.contains("timed out waiting for rank 1"), "{error}");
    }

    #[test]
    fn garbage_from_a_peer_is_refused() {
        let listener = TcpListener::bind("127.0.0.1:0").expect("bind");
        let peer = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addrs = vec![
            listener.local_addr().expect("addr"),
            peer.local_addr().expect("addr"),
        ];
        let addrs_copy = addrs.clone();
        let impostor = std::thread::spawn(move || {
            let (mut from_rank0, _) = peer.accept().expect("accept");
            let mut to_rank0 = TcpStream::connect(addrs[0]).expect("connect");
            to_rank0.write_all(&hello(1, "test")).expect("hello");
            read_hello(&mut from_rank0).expect("hello");
            to_rank0.write_all(&[0xAB; 64]).expect("garbage");
            std::thread::sleep(Duration::from_millis(500));
        });
        let mut ring = TcpRing::from_listener(0, listener, &addrs_copy, "test", TIMEOUT, TIMEOUT)
            .expect("joins");
        let mut data = vec![1.0f32; 8];
        let error = ring
            .all_reduce_sum(&mut data)
            .expect_err("garbage is refused");
        assert!(
            matches!(error, CollectiveError::Protocol { peer: 1, .. }),
            "{error}"
        );
        impostor.join().expect("impostor");
    }

    #[test]
    fn ranks_of_another_ring_and_strangers_are_turned_away() {
        let own = TcpListener::bind("127.0.0.1:0").expect("bind");
        let peer = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addrs = vec![
            own.local_addr().expect("addr"),
            peer.local_addr().expect("addr"),
        ];
        // Before rank 1 of this ring: rank 1 of another ring, and garbage.
        let mut other_ring = TcpStream::connect(addrs[0]).expect("connect");
        other_ring
            .write_all(&hello(1, "instance-b"))
            .expect("hello");
        let mut stranger = TcpStream::connect(addrs[0]).expect("connect");
        stranger.write_all(&[0xAB; 16]).expect("garbage");
        let addrs_copy = addrs.clone();
        let rank1 = std::thread::spawn(move || {
            let mut ring =
                TcpRing::from_listener(1, peer, &addrs_copy, "instance-a", TIMEOUT, TIMEOUT)
                    .expect("rank 1 joins");
            let mut data = vec![2.0f32; 4];
            ring.all_reduce_sum(&mut data).expect("all-reduce");
            data
        });
        let mut ring = TcpRing::from_listener(0, own, &addrs, "instance-a", TIMEOUT, TIMEOUT)
            .expect("rank 0 joins its own ring");
        let mut data = vec![1.0f32; 4];
        ring.all_reduce_sum(&mut data).expect("all-reduce");
        assert_eq!(data, vec![3.0; 4]);
        assert_eq!(rank1.join().expect("rank 1"), vec![3.0; 4]);
        // Both intruders were closed.
        for stream in [&mut other_ring, &mut stranger] {
            stream
                .set_read_timeout(Some(Duration::from_secs(2)))
                .expect("timeout");
            let mut buf = [0u8; 8];
            assert_eq!(stream.read(&mut buf).unwrap_or(0), 0, "closed");
        }
    }

    /// Every operation over proved and sealed connections gives what the
    /// open ring gives.
    #[test]
    fn a_sealed_ring_computes_what_the_open_ring_computes() {
        let secret = crate::dist::ring_security::new_secret().expect("secret");
        for sealed in [false, true] {
            let security = RingSecurity::with_secret(&secret, sealed).expect("security");
            for n in [2, 3] {
                let results = on_secured_ring(n, security.clone(), move |ring| {
                    let mut data = values(ring.rank(), 40_000);
                    ring.all_reduce_sum(&mut data).expect("all-reduce");
                    let mut small = values(ring.rank(), 576);
                    ring.all_reduce_sum(&mut small).expect("all-reduce");
                    let mut message = if ring.rank() == 0 {
                        b"a command".to_vec()
                    } else {
                        Vec::new()
                    };
                    ring.broadcast_bytes(0, &mut message).expect("broadcast");
                    let mut hidden = vec![0.0f32; 3];
                    if ring.rank() == 0 {
                        ring.send_next(&[1.0, 2.0, 3.0]).expect("send");
                    } else if ring.rank() == 1 {
                        ring.recv_prev(&mut hidden).expect("recv");
                    }
                    ring.barrier().expect("barrier");
                    (data, small, message, hidden)
                });
                let open = on_ring(n, |ring| {
                    let mut data = values(ring.rank(), 40_000);
                    ring.all_reduce_sum(&mut data).expect("all-reduce");
                    data
                });
                for (rank, (data, small, message, _)) in results.iter().enumerate() {
                    assert_eq!(data, &open[rank], "sealed {sealed}, {n} ranks");
                    assert_eq!(small.len(), 576);
                    assert_eq!(message, b"a command");
                }
                assert_eq!(results[1].3, vec![1.0, 2.0, 3.0]);
            }
        }
    }

    /// A rank that does not know the secret is turned away by the
    /// listener; the ranks that do still form their ring.
    #[test]
    fn a_rank_without_the_secret_is_turned_away() {
        let secret = crate::dist::ring_security::new_secret().expect("secret");
        let security = RingSecurity::with_secret(&secret, true).expect("security");
        let wrong = RingSecurity::with_secret(
            &crate::dist::ring_security::new_secret().expect("secret"),
            true,
        )
        .expect("security");
        let own = TcpListener::bind("127.0.0.1:0").expect("bind");
        let peer = TcpListener::bind("127.0.0.1:0").expect("bind");
        let addrs = vec![
            own.local_addr().expect("addr"),
            peer.local_addr().expect("addr"),
        ];
        // An impostor claims rank 1 with the right ring id, a wrong secret.
        let mut impostor = TcpStream::connect(addrs[0]).expect("connect");
        let mut greeting = hello(1, "inst");
        greeting.extend_from_slice(&wrong.connector_proof("inst", 1).expect("proof").0);
        impostor.write_all(&greeting).expect("hello");
        let addrs_copy = addrs.clone();
        let rank1_security = security.clone();
        let rank1 = std::thread::spawn(move || {
            let mut ring = TcpRing::join(
                1,
                peer,
                &addrs_copy,
                "inst",
                &rank1_security,
                TIMEOUT,
                TIMEOUT,
            )
            .expect("rank 1 joins");
            let mut data = vec![2.0f32; 4];
            ring.all_reduce_sum(&mut data).expect("all-reduce");
            data
        });
        let mut ring = TcpRing::join(0, own, &addrs, "inst", &security, TIMEOUT, TIMEOUT)
            .expect("rank 0 joins its own ring");
        let mut data = vec![1.0f32; 4];
        ring.all_reduce_sum(&mut data).expect("all-reduce");
        assert_eq!(data, vec![3.0; 4]);
        assert_eq!(rank1.join().expect("rank 1"), vec![3.0; 4]);
        impostor
            .set_read_timeout(Some(Duration::from_secs(2)))
            .expect("timeout");
        let mut buf = [0u8; 8];
        assert_eq!(impostor.read(&mut buf).unwrap_or(0), 0, "closed unanswered");
    }
}
