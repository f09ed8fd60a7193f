"""AIoT: the private-projector runner (`fedveil aiot run`) and the synthetic face population's difficulty."""
