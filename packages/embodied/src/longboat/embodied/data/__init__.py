"""LeRobot datasets: synthetic writer, reader, normalisation, sampling."""
