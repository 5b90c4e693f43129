//! `POST /cluster/join`: a machine with a join token sends its signing
//! request (HMAC'd with the token's secret); the authority's node checks
//! it, uses the invite up and answers the certificate (the exchange is
//! `tessera_trust::invite`'s).

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use tessera_protos::v1::ClusterState;
use tessera_trust::{ClusterDir, JoinReply, JoinRequest, TrustError};

use super::body::parse;
use super::context::{now_unix, Api};
use super::error::ApiError;

pub(super) async fn join(
    State(api): State<Api>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<JoinReply>, ApiError> {
    let request: JoinRequest = parse(body)?;
    let Some(folder) = api.options.cluster_dir.clone() else {
        return Err(not_authority());
    };
    let holder = request.holder.clone();
    // Before the invite is used up: the joiner may try again by another name.
    let taken = name_taken(&api.state.borrow(), &holder);
    if let Some(why) = taken {
        tracing::warn!(holder, why, "a join request was refused");
        return Err(refused(why));
    }
    let admitted =
        tokio::task::spawn_blocking(move || ClusterDir::at(folder).admit(&request, now_unix()))
            .await
            .map_err(|e| ApiError::internal(format!("admitting a joiner: {e}")))?;
    match admitted {
        Ok(reply) => {
            tracing::info!(holder, "admitted to the cluster");
            Ok(Json(reply))
        }
        Err(TrustError::Refused(why)) => {
            tracing::warn!(holder, why, "a join request was refused");
            Err(refused(why))
        }
        Err(TrustError::NotAuthority(_)) => Err(not_authority()),
        Err(error) => Err(ApiError::internal(error.to_string())),
    }
}

fn refused(why: String) -> ApiError {
    ApiError {
        code: Some("join_refused"),
        ..ApiError::new(StatusCode::FORBIDDEN, "permission_error", why)
    }
}

/// Why no certificate may name `holder`: it was revoked, or a node of the
/// log has that name (a second certificate would let its holder speak for
/// that node).
fn name_taken(state: &ClusterState, holder: &str) -> Option<String> {
    if state.revoked.iter().any(|h| h == holder) {
        return Some(format!("{holder} was revoked from this cluster"));
    }
    let known = state.nodes.contains_key(holder)
        || state.local_seqs.contains_key(holder)
        || state
            .session
            .as_ref()
            .is_some_and(|s| s.master_node_id == holder);
    known.then(|| {
        format!(
            "a member named {holder} is already in the cluster's log: join from a fresh data \
             dir (a new node id) or with another --name"
        )
    })
}

fn not_authority() -> ApiError {
    ApiError::not_found(
        "not_authority",
        "this node does not keep the cluster's authority: join through the node that ran \
         `tessera cluster init`",
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_revoked_or_known_name_is_not_given_again() {
        let mut state = ClusterState::default();
        assert_eq!(name_taken(&state, "b"), None);
        state.revoked.push("b".into());
        assert!(name_taken(&state, "b").is_some_and(|why| why.contains("revoked")));
        state.local_seqs.insert("c".into(), 3);
        assert!(name_taken(&state, "c").is_some_and(|why| why.contains("already")));
        state.nodes.insert("d".into(), Default::default());
        assert!(name_taken(&state, "d").is_some());
        assert_eq!(name_taken(&state, "laptop"), None);
    }
}
