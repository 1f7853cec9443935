"""`cde eval`'s measures of a trained model: held-out task accuracy at each decoding setting,
steering efficacy, attribution, fluency and faithfulness, through the HTTP API (`--url`) or the
gateway's own request parsing over an engine in this process (`--model`). Apart from the training
program: cde.train imports nothing from here (nor from cde.gateway)."""
