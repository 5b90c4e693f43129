//! The Downloads actor: runs the downloads the worker's [`plan`] decides on,
//! one job per model, and reports them. Each job's progress (at most once a
//! second), and its end, become `NodeDownloadProgress` local events; the end
//! also goes back to the worker, whose bookkeeping is an input of the plan.
//! The worker decides and this actor does, as with runners: the decision
//! stays one pure function over one state.
//!
//! [`plan`]: crate::worker::plan::plan

use std::collections::BTreeMap;
use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef, DerivedActorRef};
use tessera_hub::CancellationToken;
use tessera_protos::v1::{self, download_progress::State as Ds, event};

use crate::cluster::local_events::LocalEvents;
use crate::worker::downloads::{Downloader, Outcome};

/// A job's end, as the actor that asked for it is told.
#[derive(Debug)]
pub struct DownloadEnded {
    pub model_id: String,
    pub outcome: Outcome,
}

pub enum DownloadsMsg {
    /// Fetch `shards` of the model (all of it when empty), replacing (and
    /// cancelling) a job already running for it.
    Start {
        card: Box<v1::ModelCard>,
        shards: Vec<v1::ShardSpec>,
    },
    /// Stop the model's job; it ends as `Cancelled` and keeps its partial
    /// files for a later resume.
    Cancel { model_id: String },
    /// Stop the model's job, forget it and delete its files from the
    /// writable model folders.
    Delete { model_id: String },
    /// A job's progress (`job` tells a replaced job's reports apart).
    Progress {
        model_id: String,
        job: u64,
        state: Ds,
    },
    /// A job has ended.
    Done {
        model_id: String,
        job: u64,
        outcome: Outcome,
    },
}

pub struct DownloadsActor;

pub struct DownloadsArgs {
    pub downloader: Arc<Downloader>,
    pub events: Arc<LocalEvents>,
    /// Told of each job's end.
    pub ended: DerivedActorRef<DownloadEnded>,
}

struct Job {
    id: u64,
    cancel: CancellationToken,
    shards: Vec<v1::ShardSpec>,
}

pub struct DownloadsState {
    args: DownloadsArgs,
    jobs: BTreeMap<String, Job>,
    next_job: u64,
}

impl DownloadsState {
    async fn report(&self, model_id: &str, shards: Vec<v1::ShardSpec>, state: Ds) {
        self.args
            .events
            .publish_or_log(event::Kind::NodeDownloadProgress(
                v1::NodeDownloadProgress {
                    node_id: self.args.events.node_id().to_string(),
                    progress: Some(v1::DownloadProgress {
                        model_id: model_id.to_string(),
                        state: Some(state),
                        shards,
                    }),
                },
            ))
            .await;
    }

    fn start(
        &mut self,
        myself: &ActorRef<DownloadsMsg>,
        card: v1::ModelCard,
        shards: Vec<v1::ShardSpec>,
    ) {
        let model_id = card.model_id.clone();
        self.next_job += 1;
        let job = self.next_job;
        let cancel = CancellationToken::new();
        let replaced = self.jobs.insert(
            model_id.clone(),
            Job {
                id: job,
                cancel: cancel.clone(),
                shards: shards.clone(),
            },
        );
        if let Some(old) = replaced {
            old.cancel.cancel();
        }
        tracing::info!(model_id, ?shards, "downloading");
        let downloader = self.args.downloader.clone();
        let me = myself.clone();
        tokio::spawn(async move {
            let reporter = me.clone();
            let id = model_id.clone();
            let report = move |state: Ds| {
                let _ = reporter.cast(DownloadsMsg::Progress {
                    model_id: id.clone(),
                    job,
                    state,
                });
            };
            let outcome = downloader.run(&card, &shards, &report, &cancel).await;
            let _ = me.cast(DownloadsMsg::Done {
                model_id,
                job,
                outcome,
            });
        });
    }

    async fn done(&mut self, model_id: String, job: u64, outcome: Outcome) {
        let current = self.jobs.get(&model_id).is_some_and(|j| j.id == job);
        if !current {
            return; // replaced or deleted: its end was already accounted for
        }
        let Some(ended) = self.jobs.remove(&model_id) else {
            return;
        };
        match &outcome {
            Outcome::Completed { path, .. } => {
                tracing::info!(model_id, path = %path.display(), "model files ready");
            }
            Outcome::Failed(reason) => tracing::warn!(model_id, reason, "download failed"),
            Outcome::Cancelled => tracing::info!(model_id, "download cancelled"),
        }
        self.report(&model_id, ended.shards, outcome.state()).await;
        let _ = self
            .args
            .ended
            .send_message(DownloadEnded { model_id, outcome });
    }

    async fn delete(&mut self, model_id: String) {
        if let Some(job) = self.jobs.remove(&model_id) {
            job.cancel.cancel();
        }
        let store = self.args.downloader.store.clone();
        let id = model_id.clone();
        match tokio::task::spawn_blocking(move || store.delete(&id)).await {
            Ok(Ok(n)) => tracing::info!(model_id, folders = n, "deleted the model's files"),
            Ok(Err(error)) => tracing::warn!(model_id, %error, "deleting the model's files"),
            Err(error) => tracing::warn!(model_id, %error, "deleting the model's files"),
        }
    }
}

impl Actor for DownloadsActor {
    type Msg = DownloadsMsg;
    type State = DownloadsState;
    type Arguments = DownloadsArgs;

    async fn pre_start(
        &self,
        _: ActorRef<Self::Msg>,
        args: DownloadsArgs,
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(DownloadsState {
            args,
            jobs: BTreeMap::new(),
            next_job: 0,
        })
    }

    async fn handle(
        &self,
        myself: ActorRef<Self::Msg>,
        message: DownloadsMsg,
        state: &mut DownloadsState,
    ) -> Result<(), ActorProcessingErr> {
        match message {
            DownloadsMsg::Start { card, shards } => state.start(&myself, *card, shards),
            DownloadsMsg::Cancel { model_id } => {
                if let Some(job) = state.jobs.get(&model_id) {
                    // The job ends with Cancelled, which is then reported.
                    job.cancel.cancel();
                }
            }
            DownloadsMsg::Delete { model_id } => state.delete(model_id).await,
            DownloadsMsg::Progress {
                model_id,
                job,
                state: progress,
            } => {
                let shards = match state.jobs.get(&model_id) {
                    Some(current) if current.id == job => current.shards.clone(),
                    _ => return Ok(()),
                };
                state.report(&model_id, shards, progress).await;
            }
            DownloadsMsg::Done {
                model_id,
                job,
                outcome,
            } => state.done(model_id, job, outcome).await,
        }
        Ok(())
    }

    async fn post_stop(
        &self,
        _: ActorRef<Self::Msg>,
        state: &mut DownloadsState,
    ) -> Result<(), ActorProcessingErr> {
        // Jobs keep their partial files; a later run resumes them.
        for job in state.jobs.values() {
            job.cancel.cancel();
        }
        Ok(())
    }
}
