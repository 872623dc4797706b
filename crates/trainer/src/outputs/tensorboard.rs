//! TensorBoard event files, written without TensorFlow.
//!
//! An event file is a sequence of TFRecords (`u64` little-endian length, masked CRC-32C of
//! the length, the payload, masked CRC-32C of the payload). Each payload is an `Event`
//! protobuf: the first carries `file_version`, the rest a scalar `Summary` for one step. The
//! handful of protobuf fields involved are encoded by hand below.

use std::collections::BTreeMap;
use std::fs::File;
use std::io::{self, BufWriter, Write};
use std::path::{Path, PathBuf};

/// The `file_version` TensorBoard expects in the first event.
const FILE_VERSION: &str = "brain.Event:2";

/// Prefix of every event file name; TensorBoard finds files by it.
pub const EVENT_FILE_PREFIX: &str = "events.out.tfevents.";

/// Appends scalar summaries to one new event file.
pub struct EventWriter {
    file: BufWriter<File>,
    path: PathBuf,
}

impl EventWriter {
    /// Creates `dir/events.out.tfevents.<unix time>.<host>` (creating `dir` if needed) and
    /// writes the `file_version` event.
    pub fn create(dir: &Path) -> io::Result<EventWriter> {
        std::fs::create_dir_all(dir)?;
        let now = unix_time();
        let base = format!("{EVENT_FILE_PREFIX}{}.{}", now as u64, host_name());
        // Two writers started in the same second (a quick resume) must not share a file.
        let mut path = dir.join(&base);
        let mut suffix = 1;
        while path.exists() {
            path = dir.join(format!("{base}.{suffix}"));
            suffix += 1;
        }
        let mut writer = EventWriter {
            file: BufWriter::new(File::create(&path)?),
            path,
        };
        let mut event = Vec::new();
        encode_event_header(&mut event, now, 0);
        encode_bytes_field(&mut event, 3, FILE_VERSION.as_bytes());
        writer.write_record(&event)?;
        writer.file.flush()?;
        Ok(writer)
    }

    /// The file being written.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Writes one event holding every scalar of `step`, then flushes.
    pub fn add_scalars(
        &mut self,
        step: u64,
        wall_time: f64,
        scalars: &BTreeMap<String, f64>,
    ) -> io::Result<()> {
        let mut summary = Vec::new();
        for (tag, value) in scalars {
            let mut summary_value = Vec::new();
            encode_bytes_field(&mut summary_value, 1, tag.as_bytes());
            // `simple_value` is a protobuf `float`; TensorBoard stores scalars as f32 anyway.
            encode_key(&mut summary_value, 2, WIRE_FIXED32);
            summary_value.extend_from_slice(&(*value as f32).to_le_bytes());
            encode_bytes_field(&mut summary, 1, &summary_value);
        }
        let mut event = Vec::new();
        encode_event_header(&mut event, wall_time, step);
        encode_bytes_field(&mut event, 5, &summary);
        self.write_record(&event)?;
        self.file.flush()
    }

    /// Writes a `SessionLog::START` event at `step`: TensorBoard then discards every point at
    /// `step` or later read from older files of the same run, so a resumed run's curves do
    /// not show the abandoned tail twice.
    pub fn mark_restart(&mut self, step: u64) -> io::Result<()> {
        const SESSION_LOG_START: u64 = 1;
        let mut session_log = Vec::new();
        encode_key(&mut session_log, 1, WIRE_VARINT);
        encode_varint(&mut session_log, SESSION_LOG_START);
        let mut event = Vec::new();
        encode_event_header(&mut event, unix_time(), step);
        encode_bytes_field(&mut event, 7, &session_log);
        self.write_record(&event)?;
        self.file.flush()
    }

    fn write_record(&mut self, payload: &[u8]) -> io::Result<()> {
        let length = (payload.len() as u64).to_le_bytes();
        self.file.write_all(&length)?;
        self.file.write_all(&masked_crc32c(&length).to_le_bytes())?;
        self.file.write_all(payload)?;
        self.file.write_all(&masked_crc32c(payload).to_le_bytes())
    }
}

/// TFRecord's checksum: CRC-32C rotated right by 15 bits plus a constant, so that a CRC of
/// data that itself contains CRCs stays well distributed.
pub fn masked_crc32c(data: &[u8]) -> u32 {
    let crc = crc32c::crc32c(data);
    crc.rotate_right(15).wrapping_add(0xa282_ead8)
}

const WIRE_VARINT: u8 = 0;
const WIRE_FIXED64: u8 = 1;
const WIRE_LENGTH_DELIMITED: u8 = 2;
const WIRE_FIXED32: u8 = 5;

/// `Event.wall_time` (field 1, double) and `Event.step` (field 2, int64).
fn encode_event_header(out: &mut Vec<u8>, wall_time: f64, step: u64) {
    encode_key(out, 1, WIRE_FIXED64);
    out.extend_from_slice(&wall_time.to_le_bytes());
    encode_key(out, 2, WIRE_VARINT);
    encode_varint(out, step);
}

fn encode_key(out: &mut Vec<u8>, field: u32, wire_type: u8) {
    encode_varint(out, (u64::from(field) << 3) | u64::from(wire_type));
}

fn encode_bytes_field(out: &mut Vec<u8>, field: u32, bytes: &[u8]) {
    encode_key(out, field, WIRE_LENGTH_DELIMITED);
    encode_varint(out, bytes.len() as u64);
    out.extend_from_slice(bytes);
}

fn encode_varint(out: &mut Vec<u8>, mut value: u64) {
    while value >= 0x80 {
        out.push((value as u8) | 0x80);
        value >>= 7;
    }
    out.push(value as u8);
}

/// Seconds since the Unix epoch.
pub(crate) fn unix_time() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|elapsed| elapsed.as_secs_f64())
        .unwrap_or(0.0)
}

/// This machine's name for the event file name; `localhost` when it cannot be read.
fn host_name() -> String {
    let name = std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .or_else(|| std::env::var("COMPUTERNAME").ok())
        .unwrap_or_default();
    let name: String = name
        .trim()
        .chars()
        .filter(|c| c.is_ascii_alphanumeric() || matches!(c, '-' | '_' | '.'))
        .collect();
    if name.is_empty() {
        "localhost".into()
    } else {
        name
    }
}
