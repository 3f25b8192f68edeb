"""Result tooling: reads run dirs (summary.json, metrics.jsonl, spectrum.jsonl.gz), plain or
packed into archives (`results.records`), writes tables and plots.

`results.tables` puts our runs beside the Ginger paper's Tables 1-4 (numbers in `results/paper/`);
`results.plots` draws training curves, final metric against tau and Ginger's curvature spectrum.
"""
