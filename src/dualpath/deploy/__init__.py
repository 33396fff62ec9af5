"""Deployment artefacts derived from a config (NIC/switch QoS); pure text generation."""
