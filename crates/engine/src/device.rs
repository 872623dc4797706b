//! [`Device`]: which device an engine runs on, written `cpu` or `cuda:N` in recipes and
//! on the command line.

use std::fmt;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

/// A compute device, written `cpu` or `cuda:N`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Device {
    /// The CPU reference backend.
    Cpu,
    /// CUDA device with this ordinal.
    Cuda(usize),
}

impl fmt::Display for Device {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Device::Cpu => f.write_str("cpu"),
            Device::Cuda(ordinal) => write!(f, "cuda:{ordinal}"),
        }
    }
}

impl std::str::FromStr for Device {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let parsed = match text {
            "cpu" => Some(Device::Cpu),
            "cuda" => Some(Device::Cuda(0)),
            _ => text
                .strip_prefix("cuda:")
                .and_then(|ordinal| ordinal.parse().ok())
                .map(Device::Cuda),
        };
        parsed.ok_or_else(|| {
            format!("unknown device `{text}`; expected `cpu` or `cuda:N` (e.g. `cuda:0`)")
        })
    }
}

impl Serialize for Device {
    fn serialize<S: Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_str(self)
    }
}

impl<'de> Deserialize<'de> for Device {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        String::deserialize(deserializer)?
            .parse()
            .map_err(serde::de::Error::custom)
    }
}
