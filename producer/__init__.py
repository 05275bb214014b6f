"""The client library a web app or cron job uses to submit generation requests."""
