"""Training of the reference Steerling model (`python -m cde.train`): data generator, objective,
loop, export. Apart from the serving path: no serving module imports this package; and apart from
the HTTP layer: nothing here imports cde.gateway (`cde eval`, which speaks the API, is cde.eval)."""
