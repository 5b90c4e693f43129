//! Zenoh key expressions, built in this module only.
//!
//! Every key lives under `tessera/{namespace}/`, so nodes of different
//! namespaces never see each other's traffic. The message carried on each key
//! is documented in `protos/README.md`.

/// Characters that would change the meaning of a key expression.
const FORBIDDEN: &[char] = &['/', '*', '$', '?', '#', ' '];

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum KeyError {
    #[error("the {what} must not be empty")]
    Empty { what: &'static str },
    #[error("the {what} {value:?} contains {ch:?}; use letters, digits, '-', '_' or '.'")]
    Forbidden {
        what: &'static str,
        value: String,
        ch: char,
    },
}

/// The admin RPCs, one queryable each.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum AdminMethod {
    State,
    Nodes,
    Instances,
    Previews,
    Place,
    Delete,
    Models,
    Downloads,
    Events,
    AddModel,
    Download,
    Revoke,
    Draft,
}

impl AdminMethod {
    pub const ALL: [AdminMethod; 13] = [
        Self::State,
        Self::Nodes,
        Self::Instances,
        Self::Previews,
        Self::Place,
        Self::Delete,
        Self::Models,
        Self::Downloads,
        Self::Events,
        Self::AddModel,
        Self::Download,
        Self::Revoke,
        Self::Draft,
    ];

    pub fn as_str(self) -> &'static str {
        match self {
            Self::State => "state",
            Self::Nodes => "nodes",
            Self::Instances => "instances",
            Self::Previews => "previews",
            Self::Place => "place",
            Self::Delete => "delete",
            Self::Models => "models",
            Self::Downloads => "downloads",
            Self::Events => "events",
            Self::AddModel => "add_model",
            Self::Download => "download",
            Self::Revoke => "revoke",
            Self::Draft => "draft",
        }
    }
}

/// The key expressions of one namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Keys {
    prefix: String,
}

impl Keys {
    pub fn new(namespace: &str) -> Result<Self, KeyError> {
        check("namespace", namespace)?;
        Ok(Self {
            prefix: format!("tessera/{namespace}"),
        })
    }

    /// The namespace these keys live in.
    pub fn namespace(&self) -> &str {
        self.prefix.strip_prefix("tessera/").unwrap_or(&self.prefix)
    }

    /// Commands, any node → master.
    pub fn commands(&self) -> String {
        format!("{}/commands", self.prefix)
    }

    /// Unindexed local events, workers → master.
    pub fn local_events(&self) -> String {
        format!("{}/events/local", self.prefix)
    }

    /// Indexed events, master → all.
    pub fn global_events(&self) -> String {
        format!("{}/events/global", self.prefix)
    }

    /// The master's queryable for ranges of indexed events.
    pub fn event_log(&self) -> String {
        format!("{}/eventlog", self.prefix)
    }

    pub fn admin(&self, method: AdminMethod) -> String {
        format!("{}/admin/{}", self.prefix, method.as_str())
    }

    pub fn election(&self) -> String {
        format!("{}/election", self.prefix)
    }

    /// A node's liveliness token.
    pub fn alive(&self, node_id: &str) -> Result<String, KeyError> {
        check("node id", node_id)?;
        Ok(format!("{}/alive/{node_id}", self.prefix))
    }

    /// All liveliness tokens of the namespace.
    pub fn alive_any(&self) -> String {
        format!("{}/alive/*", self.prefix)
    }

    /// The node id in a liveliness key, if the key is one of this namespace.
    pub fn node_of_alive_key<'k>(&self, key: &'k str) -> Option<&'k str> {
        let rest = key
            .strip_prefix(self.prefix.as_str())?
            .strip_prefix("/alive/")?;
        (!rest.is_empty() && !rest.contains(FORBIDDEN)).then_some(rest)
    }

    /// Generation chunks of one command, runner rank 0 → API node.
    pub fn chunks(&self, command_id: &str) -> Result<String, KeyError> {
        check("command id", command_id)?;
        Ok(format!("{}/chunks/{command_id}", self.prefix))
    }

    /// Node ↔ runner child traffic; `channel` is e.g. "tasks" or "events".
    pub fn runner(&self, runner_id: &str, channel: &str) -> Result<String, KeyError> {
        check("runner id", runner_id)?;
        check("runner channel", channel)?;
        Ok(format!("{}/runner/{runner_id}/{channel}", self.prefix))
    }

    /// The `channel` of every runner of the namespace.
    pub fn runner_any(&self, channel: &str) -> Result<String, KeyError> {
        check("runner channel", channel)?;
        Ok(format!("{}/runner/*/{channel}", self.prefix))
    }

    /// The runner id in a runner key of this namespace and `channel`.
    pub fn runner_of_key<'k>(&self, key: &'k str, channel: &str) -> Option<&'k str> {
        let id = key
            .strip_prefix(self.prefix.as_str())?
            .strip_prefix("/runner/")?
            .strip_suffix(channel)?
            .strip_suffix('/')?;
        (!id.is_empty() && !id.contains(FORBIDDEN)).then_some(id)
    }
}

fn check(what: &'static str, value: &str) -> Result<(), KeyError> {
    if value.is_empty() {
        return Err(KeyError::Empty { what });
    }
    match value.chars().find(|c| FORBIDDEN.contains(c)) {
        Some(ch) => Err(KeyError::Forbidden {
            what,
            value: value.to_owned(),
            ch,
        }),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn keys_follow_the_design() -> Result<(), KeyError> {
        let keys = Keys::new("home")?;
        assert_eq!(keys.commands(), "tessera/home/commands");
        assert_eq!(keys.local_events(), "tessera/home/events/local");
        assert_eq!(keys.global_events(), "tessera/home/events/global");
        assert_eq!(keys.event_log(), "tessera/home/eventlog");
        assert_eq!(
            keys.admin(AdminMethod::Previews),
            "tessera/home/admin/previews"
        );
        assert_eq!(keys.election(), "tessera/home/election");
        assert_eq!(keys.alive("n1")?, "tessera/home/alive/n1");
        assert_eq!(keys.chunks("c-1")?, "tessera/home/chunks/c-1");
        assert_eq!(keys.runner("r1", "tasks")?, "tessera/home/runner/r1/tasks");
        assert_eq!(keys.runner_any("events")?, "tessera/home/runner/*/events");
        let events = keys.runner("r-1", "events")?;
        assert_eq!(keys.runner_of_key(&events, "events"), Some("r-1"));
        assert_eq!(keys.runner_of_key(&events, "tasks"), None);
        assert_eq!(
            keys.runner_of_key("tessera/home/runner//events", "events"),
            None
        );
        Ok(())
    }

    #[test]
    fn names_that_would_change_a_key_are_refused() {
        assert_eq!(Keys::new(""), Err(KeyError::Empty { what: "namespace" }));
        assert!(matches!(
            Keys::new("a/b"),
            Err(KeyError::Forbidden { ch: '/', .. })
        ));
        assert!(matches!(
            Keys::new("**"),
            Err(KeyError::Forbidden { ch: '*', .. })
        ));
        let keys = Keys::new("ns").ok();
        assert!(keys.is_some_and(|k| k.chunks("x/y").is_err()));
    }

    #[test]
    fn liveliness_keys_parse_back_to_node_ids() -> Result<(), KeyError> {
        let keys = Keys::new("ns")?;
        let key = keys.alive("node-7")?;
        assert_eq!(keys.node_of_alive_key(&key), Some("node-7"));
        assert_eq!(keys.node_of_alive_key("tessera/other/alive/node-7"), None);
        assert_eq!(keys.node_of_alive_key("tessera/ns/alive/"), None);
        Ok(())
    }
}
