"""Running the model: the model runner (one packed forward per step), spans and their index
arrays, CUDA graphs, CPU threads, the model set (target and draft runners) and the
tensor-parallel rank group. It knows neither sampling nor the scheduler's policy."""
