"""Data: dataset sources, drawing and loading calibration sets, synthetic pools."""
