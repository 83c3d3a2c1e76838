"""The rollout side: the contract (`api`), the HTTP client, the embedded engine and server
(`local`), and the plugin that runs inside a real SGLang server. Imports nothing heavy."""
