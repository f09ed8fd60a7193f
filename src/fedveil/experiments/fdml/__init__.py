"""FDML: the runner of `fedveil run`, its reproduce recipes, the central baseline and Alg. 1's reference."""
