"""pipefill's load generator (`loadtest run`), its reports, and the SGLang simulator."""
