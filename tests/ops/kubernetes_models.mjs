// Validate Prometheus Operator resources with @kubernetes-models/prometheus-operator.
//
//   node kubernetes_models.mjs MODELS_DIR < resources.json
//
// stdin: a JSON array of resources; stdout: a JSON array with, for each, null when valid
// or the validator's message. A kind the package lacks is reported, never passed.
import { readFileSync } from "node:fs";
import { join } from "node:path";
import { pathToFileURL } from "node:url";

const root = join(process.argv[2], "node_modules", "@kubernetes-models", "prometheus-operator");
const models = await import(pathToFileURL(join(root, "monitoring.coreos.com", "v1", "index.js")).href);
const resources = JSON.parse(readFileSync(0, "utf8"));
const results = resources.map((resource) => {
  const Model = resource.apiVersion === "monitoring.coreos.com/v1" ? models[resource.kind] : undefined;
  if (!Model) return `no model for ${resource.apiVersion} ${resource.kind}`;
  try {
    new Model(resource).validate();
    return null;
  } catch (error) {
    return String(error.message);
  }
});
process.stdout.write(JSON.stringify(results));
