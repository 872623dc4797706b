//! The workspace's dependency arrows point down: every floe crate depends only on crates of
//! a lower layer, as `docs/ARCHITECTURE.md` draws them. The layers are read from that page's
//! diagram, so the page and this check cannot drift apart.

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;

/// Layer of each crate, from the numbered lines of the diagram (`6  floe-trainer ...`).
fn documented_layers(architecture: &str) -> BTreeMap<String, u32> {
    let mut layers = BTreeMap::new();
    for line in architecture.lines() {
        let mut words = line.split_whitespace();
        let Some(layer) = words.next().and_then(|w| w.parse::<u32>().ok()) else {
            continue;
        };
        for word in words.filter(|w| w.starts_with("floe-")) {
            let name = word.trim_matches(|c: char| !c.is_ascii_alphanumeric() && c != '-');
            let earlier = layers.insert(name.to_string(), layer);
            assert!(earlier.is_none(), "{name} is drawn on two layers");
        }
    }
    layers
}

/// Each workspace crate with the floe crates it depends on (normal, dev and build).
fn workspace_dependencies(root: &Path) -> BTreeMap<String, Vec<String>> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
    let output = Command::new(cargo)
        .args([
            "metadata",
            "--format-version",
            "1",
            "--no-deps",
            "--offline",
        ])
        .current_dir(root)
        .output()
        .expect("cargo metadata runs");
    assert!(
        output.status.success(),
        "cargo metadata: {}",
        String::from_utf8_lossy(&output.stderr)
    );
    let metadata: serde_json::Value = serde_json::from_slice(&output.stdout).unwrap();
    metadata["packages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|package| {
            let deps = package["dependencies"]
                .as_array()
                .unwrap()
                .iter()
                .filter_map(|d| d["name"].as_str())
                .filter(|name| name.starts_with("floe-"))
                .map(str::to_string)
                .collect();
            (package["name"].as_str().unwrap().to_string(), deps)
        })
        .collect()
}

#[test]
fn crates_depend_only_on_lower_layers() {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("../..");
    let architecture = std::fs::read_to_string(root.join("docs/ARCHITECTURE.md")).unwrap();
    let layers = documented_layers(&architecture);
    let crates = workspace_dependencies(&root);
    let mut wrong = Vec::new();
    for (name, deps) in &crates {
        let Some(&layer) = layers.get(name) else {
            wrong.push(format!("{name} is not drawn in docs/ARCHITECTURE.md"));
            continue;
        };
        for dep in deps {
            match layers.get(dep) {
                Some(&below) if below < layer => {}
                Some(&other) => wrong.push(format!(
                    "{name} (layer {layer}) depends on {dep} (layer {other}): arrows point down"
                )),
                None => wrong.push(format!("{dep} is not drawn in docs/ARCHITECTURE.md")),
            }
        }
    }
    for name in layers.keys().filter(|name| !crates.contains_key(*name)) {
        wrong.push(format!(
            "docs/ARCHITECTURE.md draws {name}, which is not in the workspace"
        ));
    }
    assert!(wrong.is_empty(), "layering broken:\n{}", wrong.join("\n"));
}

#[test]
fn the_diagram_is_read_as_drawn() {
    let layers =
        documented_layers(" 2  floe-model   notes\n 6  floe-trainer · x   floe-server (y)\n");
    assert_eq!(layers["floe-model"], 2);
    assert_eq!((layers["floe-trainer"], layers["floe-server"]), (6, 6));
}
