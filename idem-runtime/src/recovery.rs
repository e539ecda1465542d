//! The recovery point a phased key keeps: what its attempts recorded, as
//! the phases write it and the completer, the give-up and the operators'
//! reads find it.

use serde::{Deserialize, Serialize};

/// The recovery point: each recorded result by its phase's name, whether
/// an external step may have happened, and the
/// [`external_once`](crate::Phases::external_once) steps that began (their calls
/// may have happened) without a recorded result.
#[derive(Debug, Default, Serialize, Deserialize)]
pub(crate) struct Recovery {
    #[serde(default)]
    pub(crate) steps: serde_json::Map<String, serde_json::Value>,
    #[serde(default)]
    pub(crate) external: bool,
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub(crate) begun: Vec<String>,
}

impl Recovery {
    pub(crate) fn decode(bytes: Option<&[u8]>) -> Result<Self, serde_json::Error> {
        match bytes {
            None | Some([]) => Ok(Self::default()),
            Some(bytes) => serde_json::from_slice(bytes),
        }
    }

    pub(crate) fn encode(&self) -> Vec<u8> {
        serde_json::to_vec(self).expect("a JSON map serializes")
    }
}
