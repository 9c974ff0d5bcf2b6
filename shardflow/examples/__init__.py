"""Example tasks shipped with shardflow (data files are package data)."""
