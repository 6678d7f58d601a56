"""Developer tools: check-graph (graphcheck/), the programs a config compiles (programs.py, spec_programs.py,
dspark_programs.py, vision_programs.py), export, the Neuron bring-up doctor, size and collective accounting."""
