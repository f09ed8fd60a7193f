"""The attack suite's runs on what an observer sees (`fedveil attack`)."""
