"""`bigfit bench`: the seed discussion's comparison table, measured on the user's own machine. For
each strategy x precision, in processes of its own (rows.py): the largest micro-batch that runs
(micro-batch auto's probe), the wall time to train --train-samples samples at it after a warm-up,
the wall time of one evaluation of --eval-samples samples with beam search, its BLEU (pairs) or
perplexity (text), peak memory, tokens/s; the planner's predictions beside each (driver.py). The
table, bench.md/csv/json and bench.png: report.py."""
