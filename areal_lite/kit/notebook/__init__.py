"""What the notebooks need around the learner's code: offline preparation, plots, viewers, checks.

- `prepare`: model and data prepared once for offline use (`python -m areal_lite.kit.notebook.prepare`);
- `plot`: training statistics (rewards, lengths, where the time goes); `viewer`: a batch's rows as coloured segments;
- `checks`: the exercises' named cases; `carry`: a learner's definitions carried into the next notebook;
- `overlap`: how much of the possible overlap asynchronous training achieved (notebook 07).
"""
