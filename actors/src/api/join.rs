//! `POST /cluster/join`: a machine with a join token sends its signing
//! request (HMAC'd with the token's secret); the authority's node checks
//! it, uses the invite up and answers the certificate (the exchange is
//! `tessera_trust::invite`'s).

use axum::body::Bytes;
use axum::extract::rejection::BytesRejection;
use axum::extract::State;
use axum::http::StatusCode;
use axum::Json;
use tessera_trust::{ClusterDir, JoinReply, JoinRequest, TrustError};

use super::error::ApiError;
use super::{now_unix, parse, Api};

pub(super) async fn join(
    State(api): State<Api>,
    body: Result<Bytes, BytesRejection>,
) -> Result<Json<JoinReply>, ApiError> {
    let request: JoinRequest = parse(body)?;
    let Some(folder) = api.options.cluster_dir.clone() else {
        return Err(not_authority());
    };
    let holder = request.holder.clone();
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
            Err(ApiError {
                code: Some("join_refused"),
                ..ApiError::new(StatusCode::FORBIDDEN, "permission_error", why)
            })
        }
        Err(TrustError::NotAuthority(_)) => Err(not_authority()),
        Err(error) => Err(ApiError::internal(error.to_string())),
    }
}

fn not_authority() -> ApiError {
    ApiError::not_found(
        "not_authority",
        "this node does not keep the cluster's authority: join through the node that ran \
         `tessera cluster init`",
    )
}
