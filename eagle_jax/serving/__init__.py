"""The host side: the engine's configuration, requests and results, the speculation
policies, the engine's host loop, offline generation and prompt files."""
