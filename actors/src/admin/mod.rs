//! The admin service's one error model: why a request was refused, as a
//! typed error where it is made (the master, the node's queryables, the
//! catalogue) and as `AdminError` on the wire, where both the kind's code
//! and its old string are filled.

pub mod client;

use tessera_protos::v1::{self, AdminErrorKind};

/// Why an admin request was refused; the message says it to a person.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AdminFailure {
    /// Malformed (it does not decode) or an impossible action.
    #[error("{0}")]
    InvalidArgument(String),
    #[error("{0}")]
    NotFound(String),
    /// Refused by the cluster's state (files in use, read-only, built-in).
    #[error("{0}")]
    Conflict(String),
    #[error("{0}")]
    DoesNotFit(String),
    /// May succeed later (no master, the hub unreachable).
    #[error("{0}")]
    Unavailable(String),
    #[error("{0}")]
    Internal(String),
}

impl AdminFailure {
    /// A failure of `kind` (unspecified: internal).
    pub fn new(kind: AdminErrorKind, message: impl Into<String>) -> Self {
        let message = message.into();
        match kind {
            AdminErrorKind::InvalidArgument => Self::InvalidArgument(message),
            AdminErrorKind::NotFound => Self::NotFound(message),
            AdminErrorKind::Conflict => Self::Conflict(message),
            AdminErrorKind::DoesNotFit => Self::DoesNotFit(message),
            AdminErrorKind::Unavailable => Self::Unavailable(message),
            AdminErrorKind::Internal | AdminErrorKind::Unspecified => Self::Internal(message),
        }
    }

    /// A received error, typed (its kind read by [`kind_of`]).
    pub fn from_proto(error: &v1::AdminError) -> Self {
        Self::new(kind_of(error), error.message.clone())
    }

    /// A request whose bytes do not decode as `M`.
    pub fn malformed<M>(key: &str, error: &prost::DecodeError) -> Self {
        let name = std::any::type_name::<M>();
        let name = name.rsplit("::").next().unwrap_or(name);
        Self::InvalidArgument(format!("the request on {key} is not a {name}: {error}"))
    }

    pub fn kind(&self) -> AdminErrorKind {
        match self {
            Self::InvalidArgument(_) => AdminErrorKind::InvalidArgument,
            Self::NotFound(_) => AdminErrorKind::NotFound,
            Self::Conflict(_) => AdminErrorKind::Conflict,
            Self::DoesNotFit(_) => AdminErrorKind::DoesNotFit,
            Self::Unavailable(_) => AdminErrorKind::Unavailable,
            Self::Internal(_) => AdminErrorKind::Internal,
        }
    }

    pub fn message(&self) -> &str {
        match self {
            Self::InvalidArgument(m)
            | Self::NotFound(m)
            | Self::Conflict(m)
            | Self::DoesNotFit(m)
            | Self::Unavailable(m)
            | Self::Internal(m) => m,
        }
    }

    /// The wire form, with the kind both as code and as string.
    pub fn to_proto(&self) -> v1::AdminError {
        let kind = self.kind();
        v1::AdminError {
            kind: kind_name(kind).to_string(),
            message: self.message().to_string(),
            kind_code: kind as i32,
        }
    }
}

/// The string an old reader knows a kind by.
pub fn kind_name(kind: AdminErrorKind) -> &'static str {
    match kind {
        AdminErrorKind::InvalidArgument => "invalid_argument",
        AdminErrorKind::NotFound => "not_found",
        AdminErrorKind::Conflict => "conflict",
        AdminErrorKind::DoesNotFit => "does_not_fit",
        AdminErrorKind::Unavailable => "unavailable",
        AdminErrorKind::Internal | AdminErrorKind::Unspecified => "internal",
    }
}

/// The kind of a received error: its code, else (an old writer) its
/// string; what neither names is internal.
pub fn kind_of(error: &v1::AdminError) -> AdminErrorKind {
    match AdminErrorKind::try_from(error.kind_code) {
        Ok(AdminErrorKind::Unspecified) | Err(_) => match error.kind.as_str() {
            "invalid_argument" | "invalid" => AdminErrorKind::InvalidArgument,
            "not_found" => AdminErrorKind::NotFound,
            "conflict" => AdminErrorKind::Conflict,
            "does_not_fit" => AdminErrorKind::DoesNotFit,
            "unavailable" => AdminErrorKind::Unavailable,
            _ => AdminErrorKind::Internal,
        },
        Ok(kind) => kind,
    }
}

/// An error-only reply to any admin method, encoded. Every reply of
/// admin.proto carries its error as field 15 and nothing else when it
/// failed, so these bytes are the same whatever the reply's type.
pub fn error_reply(failure: &AdminFailure) -> Vec<u8> {
    prost::Message::encode_to_vec(&v1::GetStateReply {
        error: Some(failure.to_proto()),
        ..Default::default()
    })
}

/// Decodes an admin request, or says why it is malformed.
pub fn decode_request<M: prost::Message + Default>(
    key: &str,
    payload: &[u8],
) -> Result<M, AdminFailure> {
    M::decode(payload).map_err(|error| AdminFailure::malformed::<M>(key, &error))
}

#[cfg(test)]
mod tests {
    use prost::Message;

    use super::*;

    #[test]
    fn both_fields_are_filled_and_read_back() {
        let all = [
            AdminFailure::InvalidArgument("a".into()),
            AdminFailure::NotFound("b".into()),
            AdminFailure::Conflict("c".into()),
            AdminFailure::DoesNotFit("d".into()),
            AdminFailure::Unavailable("e".into()),
            AdminFailure::Internal("f".into()),
        ];
        for failure in all {
            let wire = failure.to_proto();
            assert_eq!(kind_of(&wire), failure.kind());
            // An old writer's string alone reads the same.
            let old = v1::AdminError {
                kind_code: 0,
                ..wire.clone()
            };
            assert_eq!(kind_of(&old), failure.kind(), "{}", wire.kind);
            assert_eq!(wire.message, failure.message());
            assert_eq!(AdminFailure::from_proto(&wire), failure);
        }
    }

    #[test]
    fn old_and_unknown_strings_and_codes() {
        let old = |kind: &str| v1::AdminError {
            kind: kind.into(),
            ..Default::default()
        };
        assert_eq!(kind_of(&old("invalid")), AdminErrorKind::InvalidArgument);
        assert_eq!(kind_of(&old("what")), AdminErrorKind::Internal);
        assert_eq!(kind_of(&old("")), AdminErrorKind::Internal);
        let future = v1::AdminError {
            kind: "not_found".into(),
            kind_code: 99,
            ..Default::default()
        };
        assert_eq!(kind_of(&future), AdminErrorKind::NotFound);
    }

    #[test]
    fn an_error_reply_reads_as_every_reply_type() -> Result<(), prost::DecodeError> {
        let failure = AdminFailure::InvalidArgument("bad".into());
        let bytes = error_reply(&failure);
        let expected = Some(failure.to_proto());
        macro_rules! each_reply {
            ($($reply:ident),*) => {$(
                let error = v1::$reply::decode(bytes.as_slice())?.error;
                assert_eq!(error, expected, stringify!($reply));
            )*};
        }
        each_reply!(
            ListNodesReply,
            ListInstancesReply,
            PlacementPreviewsReply,
            PlaceInstanceReply,
            DeleteInstanceReply,
            ListModelsReply,
            ListDownloadsReply,
            EventsRangeReply,
            AddModelReply,
            DownloadReply,
            RevokeReply,
            SetDraftReply
        );
        Ok(())
    }

    #[test]
    fn garbage_is_a_malformed_request() {
        let refused = decode_request::<v1::ListDownloadsRequest>("k", &[0xff; 16]);
        match refused {
            Err(AdminFailure::InvalidArgument(message)) => {
                assert!(message.contains("ListDownloadsRequest"), "{message}")
            }
            other => panic!("{other:?}"),
        }
        assert_eq!(
            decode_request::<v1::ListDownloadsRequest>("k", &[]),
            Ok(v1::ListDownloadsRequest::default())
        );
    }
}
